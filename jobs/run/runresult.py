"""A run's result from its segment: the server's facts, the log's facts, the records.

:func:`segment_result` turns one :class:`~jobs.run.segment.Segment` that :mod:`jobs.run.runner`
drove into its :class:`~jobs.schemas.RunResult`: for a segment that ran on the server,
its cache isolation (``reset_prefix_cache`` on a reused server, else
``server_restart``), the parsed engine log (start-up facts, the stats lines logged
during the segment, typed engine events on the segment's clock) and the server's
facts; its total time; ``partial`` when it was cut short.
"""

from __future__ import annotations

import time
from typing import Any

from jobs.engine.server import EngineServer
from jobs.run.segment import Segment, Status, parse_engine_log, thin
from jobs.schemas import RunResult
from jobs.signals import engineevents, enginelog

__all__ = ["segment_result"]


def _stop_line(log: str, server: EngineServer) -> int | None:
    """The 1-based line of ``log`` from which the engine wrote after vlab stopped it (the
    last run of a server, its log read after the stop); None when ``log`` was read before
    the stop (or the engine was not stopped)."""
    after = server.log_since_stop()
    if not after or not log.endswith(after):
        return None
    return len(log[: len(log) - len(after)].splitlines()) + 1


def segment_result(
    seg: Segment,
    server: EngineServer | None,
    server_info: dict[str, Any],
    server_run_id: str | None,
) -> RunResult:
    """The :class:`RunResult` of ``seg`` (``server``: the batch's server, or None when it
    never started; ``server_run_id``: the run that started it)."""
    if server is not None and seg.engine_info.get("server_reused") is not None:
        # The segment ran on the server: server facts, isolation, log facts.
        reused = bool(seg.engine_info["server_reused"])
        seg.engine_info["cache_isolation"] = "reset_prefix_cache" if reused else "server_restart"
        seg.engine_info["server_run_id"] = server_run_id
        log = seg.engine_log or server.log_text()
        info = parse_engine_log(log)
        info["startup_facts"] = enginelog.startup_facts(log)
        info["stats_lines"] = thin(enginelog.parse_stats_lines(log)[seg.stats_before :])
        t_end = seg.t_end if seg.t_end is not None else time.perf_counter()
        wall_t0 = time.time() - (time.perf_counter() - seg.t0)  # events' clock: t_s 0
        at_end = bool(seg.engine_log)  # read at t_end: a later time is another clock's
        stop = _stop_line(log, server)
        info.update(
            engineevents.segment_info(log, wall_t0, t_end - seg.t0, not reused, at_end, stop)
        )
        seg.engine_info = {**info, **server_info, **seg.engine_info}
    elif server is not None and "pgid" in server_info:
        seg.engine_info.setdefault("pgid", server_info["pgid"])
    end = seg.t_end if seg.t_end is not None else time.perf_counter()
    seg.timings["total_s"] = max(0.0, end - seg.t0)
    status: Status = seg.status or "failed"
    partial = seg.partial
    if partial:
        seg.engine_info["partial"] = True
    return RunResult(
        run_id=seg.run_id,
        status=status,
        error=seg.error,
        partial=partial,
        metrics=seg.metrics,
        requests=seg.records,
        samples=seg.samples,
        engine_log=seg.engine_log,
        engine_info=seg.engine_info,
        timings=seg.timings,
        capacity=seg.capacity_result,
    )
