"""The dispatcher: claims queued runs, hands them to a run backend, records results.

It owns every state change of an active run. A run backend (the Ray layer in
:mod:`orchestrator.dispatch.ray.backend`; its contract in
:mod:`orchestrator.dispatch.run_backend`) reserves the run's devices and runs a
supervisor that calls :mod:`jobs`.

This module is the wiring and the loop runner. The work is seven loops, each with its
own interval, metrics and failure handling (:mod:`orchestrator.dispatch.loops`),
run in this order on each tick (every ``orchestrator.poll_interval_s``):

- **heartbeat**: this orchestrator's liveness and the cluster's resources
  (:meth:`Dispatcher.heartbeat`);
- **poll**: the active batches, their records streamed, their results recorded
  (:mod:`orchestrator.dispatch.active_runs`);
- **reconcile**: runs whose heartbeat went stale re-attached or failed, orphaned
  engines swept (:mod:`orchestrator.dispatch.reconcile`);
- **parity**: one on-demand node parity check answered
  (:mod:`orchestrator.dispatch.parity_answers`);
- **schedules**: due scheduled sweeps fired (:mod:`orchestrator.schedules.service`);
- **claim**: at most one queued run claimed and launched
  (:mod:`orchestrator.dispatch.claim`);
- **campaigns**: running tuning campaigns advanced: their next runs queued, their
  results written (:func:`orchestrator.tuning.service.advance_campaigns`).

No orphans, ever. Before it claims anything (:meth:`Dispatcher.startup`) it holds
its identity (:mod:`orchestrator.dispatch.identity`), and the runs of this
``VLAB_HOME``'s earlier orchestrators that died are reconciled at once, without
waiting for their heartbeat to go stale; a run that cannot be re-attached fails
keeping what it measured (:mod:`orchestrator.dispatch.lost_runs`); every engine
process of this home that no live run owns is killed.

A run whose supervisor dies while the orchestrator lives (``kill -9`` or an
out-of-memory kill of its Ray worker: the backend's poll is done without a result
for it) ends the same way, at once. So does one whose supervisor stops answering
(SIGSTOP, a hang): while it is silent its runs get no heartbeat and nothing is
streamed; after ``orchestrator.stale_after_s`` without an answer the backend ends
the supervisor and its poll is done without a result.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.db import unit_of_work
from orchestrator.core.repositories import OrchestratorRepository, utcnow
from orchestrator.core.settings import Settings
from orchestrator.core.telemetry import DISPATCHER_TICK, mark_dispatcher_running
from orchestrator.dispatch.active_runs import ActiveRuns
from orchestrator.dispatch.claim import Claimer
from orchestrator.dispatch.identity import Identity
from orchestrator.dispatch.loops import Loop, LoopRunner
from orchestrator.dispatch.parity_answers import answer_parity_check
from orchestrator.dispatch.reconcile import Reconciler

# the backend contract, importable from here as before
from orchestrator.dispatch.run_backend import (
    BLOCKED_PROBLEMS_SHOWN,
    LaunchBlocked,
    LaunchInfo,
    LaunchRefused,
    NoCapacity,
    Poll,
    RunBackend,
)
from orchestrator.schedules.service import fire_due_schedules
from orchestrator.tuning.service import advance_campaigns

__all__ = [
    "BLOCKED_PROBLEMS_SHOWN",
    "Dispatcher",
    "LaunchBlocked",
    "LaunchInfo",
    "LaunchRefused",
    "NoCapacity",
    "Poll",
    "RunBackend",
]

log = logging.getLogger(__name__)


@dataclass
class Dispatcher:
    settings: Settings
    session_factory: sessionmaker[Session]
    backend: RunBackend
    orchestrator_id: str = field(
        default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    )
    _started: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.identity = Identity(self.settings.home, self.orchestrator_id)
        self.runs = ActiveRuns(self.session_factory, self.backend, sweep=self.sweep_engines)
        self.reconciler = Reconciler(
            self.settings, self.session_factory, self.backend, self.runs, self.identity
        )
        self.claimer = Claimer(
            self.settings,
            self.session_factory,
            self.backend,
            self.runs,
            self.orchestrator_id,
            self.home,
        )
        self.loops = self._build_loops()

    def _build_loops(self) -> LoopRunner:
        o = self.settings.orchestrator
        parity = partial(
            answer_parity_check, self.session_factory, self.backend, self.orchestrator_id
        )
        return LoopRunner(
            [
                Loop("heartbeat", self._publish, o.heartbeat_interval_s),
                Loop("poll", self.runs.poll_all, o.active_poll_interval_s),
                Loop(
                    "reconcile",
                    self.reconciler.reconcile,
                    o.reconcile_interval_s or o.stale_after_s / 2,
                ),
                Loop("parity", parity, o.parity_interval_s),
                Loop("schedules", self._fire_schedules, o.schedules_interval_s),
                Loop("claim", self.claimer.claim_if_room, o.claim_interval_s),
                Loop("campaigns", self._advance_campaigns, o.campaigns_interval_s),
            ]
        )

    # -- the state the loops share ----------------------------------------------------------

    @property
    def active(self) -> dict[str, list[str]]:
        """Batch id (its first run's id) -> the run ids of the batch, in order."""
        return self.runs.active

    @property
    def streamed(self) -> dict[str, int]:
        """Run id -> how many of its request records are in the database (streamed so far)."""
        return self.runs.streamed

    @property
    def streamed_samples(self) -> dict[str, int]:
        """Run id -> how many of its ``/metrics`` samples are in the database."""
        return self.runs.streamed_samples

    @property
    def home(self) -> str:
        """This orchestrator's ``VLAB_HOME``, absolute: the marker of its engines."""
        return str(self.settings.home.resolve())

    # -- start-up, the loops' public faces ---------------------------------------------------

    def startup(self) -> None:
        """Before anything is claimed: hold this orchestrator's identity, publish it,
        adopt or fail the runs of dead predecessors and stale runs (keeping what they
        measured), and kill every engine process of this home that no live run owns.
        Idempotent; raises what fails (nothing is claimed then)."""
        if self._started:
            return
        self.identity.hold()
        self.heartbeat()
        self.reconcile(startup=True)
        self._started = True

    def heartbeat(self) -> None:
        """A turn of the heartbeat loop, now (raises what fails)."""
        self.loops["heartbeat"].turn()

    def reconcile(self, startup: bool = False) -> list[str]:
        """A turn of the reconcile loop, now (raises what fails): lost runs adopted or
        failed, orphaned engines swept (:meth:`Reconciler.reconcile`); returns the ids
        that were failed."""
        failed: list[str] = []
        self.loops["reconcile"].turn(
            lambda: failed.extend(self.reconciler.reconcile(startup=startup))
        )
        return failed

    def sweep_engines(self) -> list[int]:
        """Kill the engine processes of this home that no live run owns (the pids)."""
        return self.reconciler.sweep_engines()

    def _publish(self) -> None:
        """Publish this orchestrator's liveness and cluster resources (read by the API)."""
        with unit_of_work(self.session_factory) as s:
            resources: dict[str, Any] = dict(self.backend.resources())
            # the device kind this orchestrator runs with (auto-detected or set)
            resources["device_resource"] = self.backend.resource
            # per-node devices, so submissions can refuse shapes no node can hold
            resources["nodes"] = [
                {"node_id": n.node_id, "ip": n.ip, "total": n.total, "available": n.available}
                for n in self.backend.nodes()
            ]
            OrchestratorRepository(s).heartbeat(
                self.orchestrator_id, socket.gethostname(), resources
            )

    def _fire_schedules(self) -> None:
        fire_due_schedules(self.session_factory, self.settings, now=utcnow())

    def _advance_campaigns(self) -> None:
        advance_campaigns(self.session_factory, self.settings)

    # -- the runner --------------------------------------------------------------------------

    def tick(self) -> None:
        """One round: a turn of each loop that is due, in order (a failed turn is logged
        and counted, and the next loop runs; a database outage ends the round).

        Its duration is ``vlab_dispatcher_tick_duration_seconds``."""
        with DISPATCHER_TICK.time():
            self.loops.run_due()

    def run_forever(self, stop: threading.Event) -> None:
        """Tick every ``poll_interval_s`` until ``stop`` is set; cancel active runs on exit.

        Starts with :meth:`startup` (a no-op when the caller already ran it)."""
        self.startup()
        mark_dispatcher_running()  # this process's /metrics exports the dispatcher's series
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - keep the loop alive; the error is logged
                log.exception("dispatcher tick failed")
            stop.wait(self.settings.orchestrator.poll_interval_s)
        self.shutdown()

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Cancel every active run and record what they return (engines torn down), then
        give up this orchestrator's identity (its lock file)."""
        for run_id in list(self.active):
            self.backend.cancel(run_id)
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            for run_id in list(self.active):
                try:
                    self.runs.poll_one(run_id)
                except Exception:  # noqa: BLE001
                    log.exception("poll during shutdown failed")
            time.sleep(0.5)
        if not self.active:
            self.identity.release()
