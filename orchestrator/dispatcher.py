"""The dispatcher: claims queued runs, hands them to a run backend, records results.

It owns every state change of an active run. A run backend (the Ray layer in
:mod:`orchestrator.raylayer.backend`) reserves the run's devices and runs a
supervisor that calls :mod:`jobs`; the dispatcher polls it once per tick.

Claiming uses ``SELECT ... FOR UPDATE SKIP LOCKED``, so several orchestrators
can share one database without taking the same run. On start (and
periodically) runs whose heartbeat went stale are reconciled: re-attached when
their supervisor is still alive, otherwise marked failed with the reason.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from jobs.schemas import BatchJob, RunResult
from orchestrator.db import unit_of_work
from orchestrator.placement import NodeInventory
from orchestrator.repositories import (
    OrchestratorRepository,
    ParityCheckRepository,
    RunRepository,
)
from orchestrator.service import build_batch_job, record_result
from orchestrator.settings import Settings
from orchestrator.states import RunStatus, is_terminal

log = logging.getLogger(__name__)


@dataclass
class Poll:
    """What a backend knows about one active run."""

    done: bool
    results: list[RunResult] | None = None
    progress: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class LaunchInfo:
    """What a launch got: the layout (nodes, ranks, devices) and the parity report if any."""

    placement: dict[str, Any]
    parity: dict[str, Any] | None = None


class NoCapacity(Exception):
    """The run fits the cluster but its devices are busy now: it stays queued."""


class LaunchRefused(Exception):
    """The cluster can never hold the run's shape (the message says why)."""


class LaunchBlocked(Exception):
    """Node parity failed before a multi-node launch: nothing was launched."""

    def __init__(self, report: dict[str, Any], placement: dict[str, Any]) -> None:
        self.report = report
        self.placement = placement
        fields = sorted({str(m.get("field")) for m in report.get("mismatches", [])})
        super().__init__("node parity check failed: " + ", ".join(fields))


class RunBackend(Protocol):
    #: the Ray resource one device maps to ("GPU" or "CPU"), as detected or set
    resource: str

    def resources(self) -> dict[str, float]: ...

    def nodes(self) -> list[NodeInventory]: ...

    def launch(self, run_id: str, job: BatchJob, layout: dict[str, Any]) -> LaunchInfo: ...

    def check_nodes(
        self,
        node_ids: list[str] | None,
        *,
        model_dir: str | None,
        engine_args: dict[str, Any],
        tp: int = 1,
        pp: int = 1,
        revision: str | None = None,
        by_id: bool = False,
    ) -> dict[str, Any]: ...

    def poll(self, run_id: str) -> Poll: ...

    def cancel(self, run_id: str) -> None: ...

    def attach(self, run_id: str) -> bool: ...

    def release(self, run_id: str) -> None: ...


@dataclass
class Dispatcher:
    settings: Settings
    session_factory: sessionmaker[Session]
    backend: RunBackend
    orchestrator_id: str = field(
        default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    )
    #: batch id (its first run's id) -> the run ids of the batch, in order
    active: dict[str, list[str]] = field(default_factory=dict)
    _last_reconcile: float = 0.0
    _last_heartbeat: float = 0.0

    def heartbeat(self) -> None:
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
        self._last_heartbeat = time.monotonic()

    def reconcile(self) -> list[str]:
        """Adopt or fail stale non-terminal runs; returns the ids that were failed."""
        failed: list[str] = []
        with unit_of_work(self.session_factory) as s:
            repo = RunRepository(s)
            for run in repo.stale_active(self.settings.orchestrator.stale_after_s):
                if any(run.id in ids for ids in self.active.values()):
                    continue
                if self.backend.attach(run.id):
                    run.claimed_by = self.orchestrator_id
                    repo.heartbeat(run.id, None)
                    self.active[run.id] = [run.id]
                    log.info("re-attached to run %s", run.id)
                else:
                    repo.transition(
                        run,
                        RunStatus.FAILED,
                        "orchestrator restarted and the run's supervisor is gone",
                    )
                    run.error = run.error or "orchestrator lost the run: supervisor not found"
                    failed.append(run.id)
        self._last_reconcile = time.monotonic()
        return failed

    def tick(self) -> None:
        """One round: poll active runs, fire due schedules, then claim at most one queued run."""
        if time.monotonic() - self._last_heartbeat > 5.0:
            self.heartbeat()
        for batch_id in list(self.active):
            self._poll_one(batch_id)
        if time.monotonic() - self._last_reconcile > self.settings.orchestrator.stale_after_s / 2:
            self.reconcile()
        self._answer_parity_check()
        try:
            from orchestrator.repositories import utcnow
            from orchestrator.schedules import fire_due_schedules

            fire_due_schedules(self.session_factory, self.settings, now=utcnow())
        except Exception:  # noqa: BLE001 - scheduled sweeps must not stop dispatching
            log.exception("firing scheduled sweeps failed")
        if len(self.active) < self.settings.orchestrator.max_concurrent_runs:
            self._claim_one()

    def _answer_parity_check(self) -> None:
        """Answer at most one pending ``POST /cluster/parity`` request."""
        with unit_of_work(self.session_factory) as s:
            repo = ParityCheckRepository(s)
            check = repo.claim_next(self.orchestrator_id)
            if check is None:
                return
            req = check.request
            try:
                report = self.backend.check_nodes(
                    req.get("node_ids"),
                    model_dir=req.get("model_path"),
                    engine_args=req.get("engine_args") or {},
                    tp=int(req.get("tensor_parallel_size", 1)),
                    pp=int(req.get("pipeline_parallel_size", 1)),
                )
            except Exception as exc:  # noqa: BLE001 - stored as the check's error
                log.warning("parity check %s failed: %s", check.id, exc)
                repo.finish(check, None, f"{type(exc).__name__}: {exc}"[:4000])
                return
            repo.finish(check, report)

    def _poll_one(self, batch_id: str) -> None:
        poll = self.backend.poll(batch_id)
        run_ids = self.active[batch_id]
        with unit_of_work(self.session_factory) as s:
            repo = RunRepository(s)
            runs = [r for rid in run_ids if (r := repo.get(rid, for_update=True)) is not None]
            live = [r for r in runs if not is_terminal(r.status)]
            if not live:
                self.active.pop(batch_id, None)
                self.backend.release(batch_id)
                return
            if poll.done:
                results = {res.run_id: res for res in poll.results or []}
                for run in live:
                    result = results.get(run.id) or RunResult(
                        run_id=run.id,
                        status="failed",
                        error=poll.error or "run supervisor returned no result for this run",
                    )
                    record_result(s, run, result)
                    log.info("run %s ended %s", run.id, result.status)
                self.active.pop(batch_id, None)
                self.backend.release(batch_id)
                return
            if any(r.cancel_requested for r in live):
                self.backend.cancel(batch_id)  # the batch's server stops; its runs end cancelled
            progress = poll.progress or {}
            current = progress.get("run_id") or run_ids[0]
            for run in live:
                if run.id == current:
                    if run.status == RunStatus.PREPARING.value and progress.get("phase") in (
                        "warmup",
                        "measuring",
                    ):
                        repo.transition(run, RunStatus.RUNNING)
                    repo.heartbeat(run.id, progress or None)
                else:
                    repo.heartbeat(run.id, None)

    def _claim_one(self) -> None:
        with unit_of_work(self.session_factory) as s:
            repo = RunRepository(s)
            run = repo.claim_next_queued(self.orchestrator_id)
            if run is None:
                return
            batch = [run, *repo.claim_server_mates(run, self.orchestrator_id)]
            job = build_batch_job(self.settings, batch, self.backend.resource)
            try:
                info = self.backend.launch(run.id, job, run.layout)
            except NoCapacity:
                s.rollback()  # leaves the runs queued for a later tick
                return
            except LaunchBlocked as exc:
                log.warning("run %s blocked: %s", run.id, exc)
                for r in batch:
                    r.parity, r.placement = exc.report, exc.placement
                    repo.transition(r, RunStatus.BLOCKED, str(exc))
                    r.error = f"{exc}; see GET /api/v1/runs/{r.id}/parity"
                return
            except LaunchRefused as exc:
                for r in batch:
                    repo.transition(r, RunStatus.FAILED, str(exc))
                    r.error = str(exc)
                return
            except Exception as exc:  # noqa: BLE001 - any launch failure ends the runs
                log.exception("launch of run %s failed", run.id)
                for r in batch:
                    repo.transition(r, RunStatus.FAILED, f"launch failed: {exc}")
                    r.error = f"launch failed: {exc}"
                self.backend.release(run.id)
                return
            for r in batch:
                r.placement, r.parity = info.placement, info.parity
            self.active[run.id] = [r.id for r in batch]

    def run_forever(self, stop: threading.Event) -> None:
        """Tick every ``poll_interval_s`` until ``stop`` is set; cancel active runs on exit."""
        self.heartbeat()
        self.reconcile()
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - keep the loop alive; the error is logged
                log.exception("dispatcher tick failed")
            stop.wait(self.settings.orchestrator.poll_interval_s)
        self.shutdown()

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Cancel every active run and record what they return (engines torn down)."""
        for run_id in list(self.active):
            self.backend.cancel(run_id)
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            for run_id in list(self.active):
                try:
                    self._poll_one(run_id)
                except Exception:  # noqa: BLE001
                    log.exception("poll during shutdown failed")
            time.sleep(0.5)
