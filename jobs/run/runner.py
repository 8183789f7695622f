"""Execute runs on this node: a :class:`~jobs.schemas.RunJob` (or a
:class:`~jobs.schemas.BatchJob` of runs sharing one server) in, :class:`RunResult` out.

Steps of :func:`execute_batch` (progress phases in brackets; every report
carries the ``run_id`` it is about):

1. build each segment's request list from its workload with the served
   model's tokenizer (:func:`jobs.load.workload.build_requests`; warm-ups first);
2. start the vLLM server once [``starting``] and wait for ``/health``
   [``waiting_health``]; a process of it that stays stopped (SIGSTOP) for
   :data:`jobs.run.enginewatch.HANG_AFTER_S` s meanwhile fails the start at once, not at the
   start-up timeout;
3. for each segment, in order:

   a. send its warm-up requests one at a time [``warmup``], then
      ``POST /reset_prefix_cache`` so a warm cache (the warm-up's, or an
      earlier segment's on a reused server) never leaks into the measured
      numbers (if the reset fails while APC may be on and there was
      something to forget, the segment fails);
   b. scrape ``/metrics`` (``before``), drive the measured requests (closed
      loop at the segment's ``concurrency``, or open loop at their
      ``arrival_s``; multi-turn requests after their previous turn; until
      ``duration_s`` if set) while a background task scrapes every
      ``job.scrape_interval_s`` (``during``) [``measuring``], scrape
      ``after``; the segment is then ``done``. The warm-cache check
      (:mod:`jobs.signals.cachecheck`) flags, never fails, a phase that began on a warm
      prefix cache (``engine_info["cache_contamination"]``). If the engine hangs (its
      processes run, but no ``/health`` answer, ``/metrics`` scrape or streamed byte
      for :data:`jobs.run.enginewatch.HANG_AFTER_S` s, or one is stopped; warm-up
      included), the load is abandoned, the segment
      fails ``partial`` with what was measured, and the batch ends. If the
      engine dies (any process of its group that ran when it became healthy:
      API server, engine core, workers; checked every
      :data:`ENGINE_WATCH_INTERVAL_S` s) or its port refuses a connection, the
      load stops at once and the segment fails the same way, with the error
      lines the engine logged since it became healthy. A segment whose share
      of failed measured requests is above ``job.max_failed_fraction`` fails
      too (``partial``): its numbers are no valid measurement;
   c. a segment with ``capacity`` runs a capacity search instead of b.: load
      steps on the same server, each after a prefix cache reset, replaying the
      first requests of the same request list at the step's load for as long as
      the search planned (a steady state; cut ``drain_s`` after its last
      arrival), with ``/metrics`` scraped as in b. and the load generator's CPU
      time measured, progress ``"capacity step 3: 4.2 req/s"``
      (:mod:`jobs.capacity.loadsteps`, which says which step's records the run
      keeps); the engine is watched as in b., and the run fails only when no
      request of any step succeeded;

4. stop the server, always [``stopping``], and finish the last results [``done``].

:func:`execute` is the one-segment case (one run, one server).

Client-side metrics follow ``vllm bench serve`` (:func:`jobs.load.loadgen.summarize`,
with the segment's goodput SLOs), server-side ones are ``/metrics`` counter
deltas (:func:`jobs.signals.enginemetrics.summarize_samples`) and latency-histogram deltas
between the ``before`` and ``after`` scrapes
(:func:`jobs.signals.histograms.summarize_histograms`:
``server_mean_ttft_ms``... and ``mean_ttft_client_minus_server_ms``, the
client's mean TTFT minus the server's for the same requests). Each result's
``engine_info`` also carries the parsed start-up facts (``startup_facts``) and
the engine's periodic stats lines logged during the segment (``stats_lines``,
:mod:`jobs.signals.enginelog`; at most :data:`jobs.run.segment.MAX_STATS_LINES`, evenly
thinned) and typed events (:func:`jobs.signals.engineevents.segment_info`, on the segment's
clock). Each run's state and the numbers derived from its records are in :mod:`jobs.run.segment`.

Time offsets (``start_s`` of records, ``t_s`` of samples) are seconds since
the segment began; the first segment begins with the call (its offsets
include the server start-up, as in :func:`execute`), later ones when the
previous one ended.

Neither function raises for an engine or workload problem: they become
``status="failed"`` with ``error`` carrying the engine's error lines; a set
``cancel`` event gives ``status="cancelled"``. No engine process is left
running when they return.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from jobs.capacity import loadsteps
from jobs.engine.processes import group_members
from jobs.engine.server import EngineCancelledError, EngineDiedError, EngineError, EngineServer
from jobs.load.workload import build_requests, request_list_hash
from jobs.modelgen.generator import load_tokenizer
from jobs.run import enginewatch, journal, runresult
from jobs.run.drive import drive
from jobs.run.segment import Segment, Status
from jobs.schemas import (
    BatchJob,
    MetricSample,
    Progress,
    RequestRecord,
    RunJob,
    RunResult,
    RunSegment,
)
from jobs.signals import enginelog

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[Progress], None]


class _Cancelled(Exception):
    """Internal: the cancel event was set between steps."""


def execute(
    job: RunJob,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> RunResult:
    """Run ``job`` end to end on this node and return its :class:`RunResult`.

    A one-segment :func:`execute_batch` (the server is started for this run
    and stopped after it).

    Args:
        job: the run (engine launch, workload, scrape interval in seconds,
            per-request timeout in seconds).
        progress: called (in the calling thread) at each phase change and
            after each finished measured request; its exceptions are logged
            and ignored.
        cancel: set it from any thread to stop the run early: the start-up
            wait or the load is abandoned, the server stopped, and the result
            has ``status="cancelled"`` with whatever was measured.

    Returns:
        ``RunResult`` with ``status`` ``succeeded`` / ``failed`` /
        ``cancelled``. ``metrics``: :func:`jobs.load.loadgen.summarize` of the
        measured requests merged with :func:`jobs.signals.enginemetrics.summarize_samples`;
        ``requests``: warm-ups (``warmup=True``) then measured records;
        ``samples``: ``before`` / ``during`` / ``after`` scrapes;
        ``engine_log``: the whole server log; ``engine_info``: ``command``,
        ``port``, ``pgid`` (the server's process group, gone on return),
        ``vllm_version`` (from the log), ``startup_s``, ``request_list_hash``,
        ``prefix_cache_reset_ok``, ``cache_contamination`` (:mod:`jobs.signals.cachecheck`),
        KV cache size, ``exit_code``,
        ``server_reused`` (False), ``cache_isolation`` (``"server_restart"``),
        ``segment_index`` (0), ``segments_total`` (1);
        ``timings`` (seconds): ``startup_s``, ``warmup_s``, ``measure_s``,
        ``stop_s``, ``total_s``.

    Never raises for an engine or workload problem; the engine is stopped
    (its whole process group) before returning.
    """
    batch = BatchJob(
        launch=job.launch,
        segments=[
            RunSegment(
                run_id=job.run_id, workload=job.workload, goodput_slos_ms=job.goodput_slos_ms
            )
        ],
        scrape_interval_s=job.scrape_interval_s,
        request_timeout_s=job.request_timeout_s,
    )
    return execute_batch(batch, progress, cancel)[0]


def execute_batch(
    job: BatchJob,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    telemetry: Callable[[], dict[str, float]] | None = None,
    on_record: Callable[[str, RequestRecord], None] | None = None,
    on_sample: Callable[[str, MetricSample], None] | None = None,
) -> list[RunResult]:
    """Run the segments of ``job`` on one vLLM server, in order; one :class:`RunResult` each.

    For runs that differ only in client-side settings (workload, concurrency,
    request list...): the server is started once for ``job.launch``, and
    between segments the prefix cache is reset (``POST /reset_prefix_cache``,
    after each segment's warm-up and before its measured requests).

    Args:
        job: the launch, the segments (``run_id`` + workload each), scrape
            interval and per-request timeout (seconds) shared by all.
        progress: as for :func:`execute`; every report carries the ``run_id``
            of the segment it is about, and each segment gets its own
            ``done`` report as soon as its status is final.
        cancel: set it from any thread: the current segment ends
            ``cancelled`` (with whatever was measured), the segments not yet
            started are ``cancelled`` too, and the server is stopped.

    Returns:
        One ``RunResult`` per segment, in order, with the fields described in
        :func:`execute`, except:

        - ``engine_info``: ``server_reused`` (False for the segment that
          started the server, True after), ``cache_isolation``
          (``"server_restart"`` for the segment that started the server,
          ``"reset_prefix_cache"`` on a reused server), ``segment_index``,
          ``segments_total``, ``server_run_id`` (the run that started the
          server); ``startup_s`` only on the first segment;
        - ``timings``: ``startup_s`` on the first segment only; the others have
          ``startup_saved_s`` (the first segment's start-up seconds); ``stop_s``
          on the last segment that ran; ``total_s`` is the segment's own
          duration (the first includes the start-up, the last the stop);
        - ``engine_log``: the whole server log from its start up to the end of
          that segment (the last segment that ran: up to the server's exit).

        A server that dies mid-batch fails the current segment and every later
        one with the engine's error lines; a segment whose request list
        cannot be built fails alone; a segment-level problem (failed prefix
        cache reset, all requests failed) fails that segment and the batch
        goes on while the server is healthy.

    ``telemetry`` (optional, e.g. the GPUs' readings of :mod:`jobs.signals.gpus`) is called
    in a worker thread with every ``/metrics`` scrape (before, each second during,
    after); its ``{key: float}`` is merged into that sample's values. Its errors are
    noted in ``engine_info["telemetry_errors"]``, never raised.

    ``on_record`` (optional) gets ``(run_id, record)`` for every request record as
    soon as the request finished (warm-ups too, marked), in the event-loop thread:
    what was measured can be kept even if this process dies before the end;
    ``on_sample`` the same for every ``/metrics`` sample. Both go first to the run's
    journal beside the engine log (:mod:`jobs.run.journal`). Their exceptions are logged.

    Never raises for an engine or workload problem; the engine is stopped
    (its whole process group) before returning.
    """
    sink = journal.Journal(job.launch.log_path, on_record, on_sample)
    return _Batch(job, progress, cancel or threading.Event(), telemetry, sink).execute()


#: Seconds to wait, after the port refused a connection, for the dead process to show.
_REFUSED_WAIT_S = 2.0
#: Seconds to wait, after an engine process was seen gone, for the engine's own log lines
#: about it (they are the run's error; without them only our observation is reported);
#: the wait ends sooner when no process of the engine is left to write them.
_DEATH_LINES_WAIT_S = 3.0


class _Batch:
    """State of one :func:`execute_batch` call."""

    def __init__(
        self,
        job: BatchJob,
        progress: ProgressCallback | None,
        cancel: threading.Event,
        telemetry: Callable[[], dict[str, float]] | None = None,
        sink: journal.Journal | None = None,
    ) -> None:
        self.job = job
        self.telemetry = telemetry
        self.journal = sink or journal.Journal(None)
        self.progress_cb = progress
        self.cancel = cancel
        total = len(job.segments)
        self.segments = [Segment(seg, i, total) for i, seg in enumerate(job.segments)]
        self.server: EngineServer | None = None
        self.server_info: dict[str, Any] = {}
        self.startup_s: float | None = None
        self.server_run_id: str | None = None

    # -- helpers ------------------------------------------------------------------------

    def report(
        self,
        seg: Segment | None,
        phase: Any,
        message: str = "",
        done: int | None = None,
        total: int | None = None,
    ) -> None:
        """Report a phase; the counters default to the segment's measured requests
        (finished, planned), so no report says "400 of 0"."""
        if self.progress_cb is None:
            return
        if done is None:
            done = seg.measured_done if seg is not None else 0
        if total is None:
            total = seg.measured_total if seg is not None else 0
        try:
            self.progress_cb(
                Progress(
                    phase=phase,
                    requests_done=done,
                    requests_total=total,
                    message=message,
                    run_id=seg.run_id if seg is not None else None,
                )
            )
        except Exception:
            logger.exception("progress callback failed")

    def check_cancel(self) -> None:
        if self.cancel.is_set():
            raise _Cancelled()

    def finish(self, seg: Segment, status: Status, error: str | None) -> None:
        """Make ``seg``'s status final (once) and snapshot the log up to now."""
        if seg.status is not None:
            return
        seg.status, seg.error = status, error
        seg.t_end = time.perf_counter()
        if self.server is not None and seg.engine_info.get("server_reused") is not None:
            seg.engine_log = self.server.log_text()

    # -- main flow ----------------------------------------------------------------------

    def execute(self) -> list[RunResult]:
        self._build_requests()
        pending = [s for s in self.segments if s.status is None]
        last_ran: Segment | None = None
        if pending:
            current: Segment | None = pending[0]
            try:
                self.check_cancel()
                self._start_server(pending[0])
                for seg in pending:
                    current = seg
                    self._run_segment(seg, reused=seg is not pending[0])
                    last_ran = seg
                    current = None
                    if seg is not pending[-1]:  # the last one is done once the server stopped
                        seg.done_reported = True
                        self.report(seg, "done", seg.status or "")
            except (_Cancelled, EngineCancelledError):
                self._end_all(current, pending, "cancelled", "cancelled", "cancelled")
            except EngineError as exc:
                self._end_all(current, pending, "failed", str(exc), None)
            except Exception as exc:
                logger.exception("batch of %s failed", [s.run_id for s in pending])
                error = f"internal error: {exc!r}\n{traceback.format_exc(limit=8)}"
                if self.server is not None and self.server.returncode is not None:
                    error += "\n--- engine log (error lines) ---\n" + "\n".join(
                        self.server.error_lines()
                    )
                self._end_all(current, pending, "failed", error, None)
            finally:
                if current is not None:
                    last_ran = current
                self._stop_server(last_ran or pending[0])
        self.journal.close()
        return [self._result(seg) for seg in self.segments]

    def _build_requests(self) -> None:
        tokenizer: Any = None
        for seg in self.segments:
            try:
                if tokenizer is None:
                    launch = self.job.launch
                    tokenizer = load_tokenizer(launch.tokenizer_dir or launch.model_dir)
                workload = seg.workload
                if seg.capacity is not None:
                    workload = loadsteps.capacity_workload(workload, seg.capacity)
                seg.requests = build_requests(workload, tokenizer)
            except Exception as exc:
                logger.exception("cannot build the request list of run %s", seg.run_id)
                seg.status, seg.error = "failed", f"cannot build the request list: {exc!r}"
                seg.t_end = time.perf_counter()
                continue
            seg.engine_info["request_list_hash"] = request_list_hash(seg.requests)
            seg.measured_total = len(seg.measured)

    def _start_server(self, first: Segment) -> None:
        server = self.server = EngineServer(self.job.launch)
        self.server_run_id = first.run_id
        first.engine_info["server_reused"] = False
        self.report(first, "starting", "launching vLLM")
        server.start()
        self.server_info = server.info()
        self.report(first, "waiting_health", f"waiting for {server.base_url}/health")
        self.startup_s = server.wait_healthy(
            self.cancel,
            self.job.launch.startup_timeout_s,
            stopped_after_s=enginewatch.HANG_AFTER_S,  # a stopped engine never comes up
        )
        self.server_info.update(server.info())  # a retry on a new port changes them
        first.timings["startup_s"] = self.startup_s
        first.engine_info["startup_s"] = self.startup_s

    def _run_segment(self, seg: Segment, reused: bool) -> None:
        """Warm-up, reset, measure one segment; raise only for batch-ending problems.

        Cancellation and a dead server propagate (they end the batch); any
        other problem fails this segment only.
        """
        server = self.server
        assert server is not None
        self.check_cancel()
        if reused:
            seg.t0 = time.perf_counter()
            seg.engine_info["server_reused"] = True
            if self.startup_s is not None:
                seg.timings["startup_saved_s"] = self.startup_s
        seg.stats_before = len(enginelog.parse_stats_lines(server.log_text()))
        try:
            asyncio.run(drive(self, server, seg, reused))
            self.check_cancel()
            self.raise_if_dead(server, seg)
            status, error = seg.judge(self.job.max_failed_fraction)
        except (_Cancelled, EngineCancelledError, EngineDiedError):
            raise
        except EngineError as exc:
            self.raise_if_dead(server, seg)  # a dead server ends the batch instead
            status, error = "failed", str(exc)
        except Exception as exc:
            logger.exception("run %s failed", seg.run_id)
            self.raise_if_dead(server, seg)
            status = "failed"
            error = f"internal error: {exc!r}\n{traceback.format_exc(limit=8)}"
        if seg.unresponsive is not None:  # the engine hung: end this run and the batch
            raise enginewatch.hang_error(server, seg)
        self.finish(seg, status, error)

    def raise_if_dead(self, server: EngineServer, seg: Segment, wait_s: float = 0.0) -> None:
        """Raise :class:`EngineDiedError` when the engine died or its port refused us.

        ``wait_s``: how long to give a death to show (its processes exit a moment after
        the sign the caller saw); after a refused port at least :data:`_REFUSED_WAIT_S`.
        The message says which process went, when in the run it was seen, and what
        had been measured; ``log_lines`` are the error lines logged since the server
        became healthy.
        """
        reason = seg.dead or server.death()
        if seg.refused:
            wait_s = max(wait_s, _REFUSED_WAIT_S)  # the port closed
        if reason is None and wait_s > 0:
            deadline = time.monotonic() + wait_s
            while (reason := server.death()) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if reason is None and seg.refused:
                reason = (
                    f"the vLLM server at {server.base_url} refused connections (nothing "
                    "listens on its port) although its processes still run"
                )
        if reason is None:
            return
        at = seg.dead_at if seg.dead_at is not None else seg.now()
        done = [r for r in seg.records if not r.warmup]
        ok = sum(1 for r in done if r.success)
        # we see a process gone within 0.1 s; vLLM's own lines about it ("engine core
        # exited unexpectedly", EngineDeadError) follow a moment later: wait for them,
        # unless no process of the engine is left to write them (SIGKILLed whole)
        lines = server.run_error_lines()
        deadline = time.monotonic() + _DEATH_LINES_WAIT_S
        while not lines and time.monotonic() < deadline:
            writers_gone = server.pgid is None or not group_members(server.pgid)
            time.sleep(0.1)
            lines = server.run_error_lines()  # what they wrote before they went included
            if writers_gone:
                break
        raise EngineDiedError(
            f"the vLLM engine died during run {seg.run_id}: {reason}; seen {at:.1f} s into "
            f"the run, when the load was stopped ({ok} measured requests had succeeded, "
            f"{len(done) - ok} failed, of {seg.measured_total} planned)",
            lines,
        )

    def _end_all(
        self,
        current: Segment | None,
        pending: list[Segment],
        status: Status,
        error: str,
        later_error: str | None,
    ) -> None:
        """End ``current`` with ``status``/``error`` and every not-started segment too.

        ``later_error`` (default: ``error`` prefixed with the run it happened in)
        is the error of the segments that never started.
        """
        if current is not None:
            self.finish(current, status, error)
        where = current.run_id if current is not None else "?"
        for seg in pending:
            if seg.status is None:
                msg = (
                    later_error or f"not run: the shared vLLM server failed in run {where}: {error}"
                )
                seg.status, seg.error = status, msg
                seg.t_end = time.perf_counter()

    def _stop_server(self, last: Segment) -> None:
        server = self.server
        if server is None:
            return
        self.report(last, "stopping", "stopping vLLM")
        t_stop = time.perf_counter()
        try:
            self.server_info["exit_code"] = server.stop()
        except EngineError as exc:  # processes survived SIGKILL: report it
            last.status, last.error = "failed", str(exc)
        last.timings["stop_s"] = time.perf_counter() - t_stop
        last.t_end = time.perf_counter()
        if last.engine_info.get("server_reused") is not None:
            last.engine_log = server.log_text()

    def _result(self, seg: Segment) -> RunResult:
        result = runresult.segment_result(seg, self.server, self.server_info, self.server_run_id)
        if not seg.done_reported:
            seg.done_reported = True
            self.report(seg, "done", result.status)
        return result
