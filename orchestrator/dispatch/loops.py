"""The dispatcher's loops: small jobs, each with its own interval, metrics and failure handling.

The dispatcher (:mod:`orchestrator.dispatch.dispatcher`) is seven loops, run in this
order on each tick (every ``orchestrator.poll_interval_s``) when they are due:

========== ============================================= ===================================
loop       what one turn does                            interval setting (default)
========== ============================================= ===================================
heartbeat  publish liveness and cluster resources        ``heartbeat_interval_s`` (5 s)
poll       poll active runs, stream records, end done    ``active_poll_interval_s`` (tick)
reconcile  adopt or fail lost runs, sweep engines        ``reconcile_interval_s``
                                                         (``stale_after_s / 2``)
parity     answer one ``POST /cluster/parity`` check     ``parity_interval_s`` (tick)
schedules  fire due scheduled sweeps                     ``schedules_interval_s`` (tick)
claim      claim and launch at most one queued run       ``claim_interval_s`` (tick)
campaigns  advance running tuning campaigns              ``campaigns_interval_s`` (5 s)
========== ============================================= ===================================

(settings of ``orchestrator``, ``VLAB_ORCHESTRATOR__<NAME>``). A loop whose interval
is ``None`` runs on every tick; otherwise on the first tick at least its interval
after its last successful turn (a failed turn is tried again on the next tick), so
an interval is rounded up to whole ticks.

Failure handling: a turn that raises is counted and logged with its traceback, and
the next loop runs; the loop that failed is tried again on the next tick. A database
outage is the whole dispatcher's, not one loop's: it is counted as the failing loop's,
logged once per outage (:data:`orchestrator.core.db.database_health`, no traceback)
and ends the tick, as every other loop would wait on the same database.

Metrics, per ``loop`` label (:mod:`orchestrator.core.telemetry`):
``vlab_dispatcher_loop_runs_total``, ``vlab_dispatcher_loop_failures_total``,
``vlab_dispatcher_loop_seconds`` (a histogram of turn durations, failed ones
included) and ``vlab_dispatcher_loop_last_success_timestamp_seconds``.

Why one thread for seven loops: they share the dispatcher's state in memory (the
batches it holds and how much of each run's measurements is in the database), which
one thread keeps consistent without locks, and the order of a tick matters (a batch
that just ended frees its room before the claim loop looks). A slow turn (a launch)
delays the next loops' turn, as it always did; it never stops them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from orchestrator.core.db import database_health, is_unavailable
from orchestrator.core.telemetry import (
    DISPATCHER_LOOP_FAILURES,
    DISPATCHER_LOOP_LAST_SUCCESS,
    DISPATCHER_LOOP_RUNS,
    DISPATCHER_LOOP_SECONDS,
)

log = logging.getLogger(__name__)


@dataclass
class Loop:
    """One job of the dispatcher: ``step`` run once per turn, when due."""

    name: str
    step: Callable[[], object]
    #: seconds between successful turns; None: every tick
    interval_s: float | None = None
    #: ``time.monotonic()`` of the last successful turn, None before the first
    last_success: float | None = None

    def due(self, now: float) -> bool:
        """Whether the loop runs on a tick at ``now`` (``time.monotonic()``)."""
        if self.interval_s is None or self.last_success is None:
            return True
        return now - self.last_success > self.interval_s

    def turn(self, step: Callable[[], object] | None = None) -> None:
        """Run one turn (``step``, or the loop's own), counted and timed as the loop's;
        raises what the step raised (counted as a failure)."""
        labels = {"loop": self.name}
        DISPATCHER_LOOP_RUNS.labels(**labels).inc()
        t0 = time.perf_counter()
        try:
            (step or self.step)()
        except BaseException:
            DISPATCHER_LOOP_FAILURES.labels(**labels).inc()
            raise
        finally:
            DISPATCHER_LOOP_SECONDS.labels(**labels).observe(time.perf_counter() - t0)
        self.last_success = time.monotonic()
        DISPATCHER_LOOP_LAST_SUCCESS.labels(**labels).set_to_current_time()


@dataclass
class LoopRunner:
    """The loops of one dispatcher, run in order on each tick (:meth:`run_due`)."""

    loops: list[Loop] = field(default_factory=list)

    def __getitem__(self, name: str) -> Loop:
        for loop in self.loops:
            if loop.name == name:
                return loop
        raise KeyError(name)

    def __iter__(self) -> Iterator[Loop]:
        return iter(self.loops)

    def run_due(self) -> list[str]:
        """One tick: a turn of each loop that is due, in order. A failed turn is logged
        and the next loop runs; a database outage ends the tick. Returns the names of
        the loops that failed."""
        failed: list[str] = []
        for loop in self.loops:
            if not loop.due(time.monotonic()):
                continue
            try:
                loop.turn()
            except Exception as exc:  # noqa: BLE001 - one loop's failure never stops the others
                failed.append(loop.name)
                if is_unavailable(exc):  # one log line per outage, not a traceback per tick
                    database_health.failed(exc, "dispatcher")
                    break
                log.exception("dispatcher loop %s failed", loop.name)
        return failed
