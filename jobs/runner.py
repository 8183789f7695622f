"""Execute one run on this node: :class:`~jobs.schemas.RunJob` in, :class:`RunResult` out.

Steps of :func:`execute` (progress phases in brackets):

1. build the request list from ``job.workload`` with the served model's
   tokenizer (:func:`jobs.workload.build_requests`; warm-ups first);
2. start the vLLM server [``starting``] and wait for ``/health``
   [``waiting_health``];
3. send the warm-up requests one at a time [``warmup``], then
   ``POST /reset_prefix_cache`` so a warm cache never leaks into the measured
   numbers (if the reset fails while APC may be on, the run fails);
4. scrape ``/metrics`` (``before``), drive the measured requests with
   ``job.workload.concurrency`` in a closed loop while a background task
   scrapes every ``job.scrape_interval_s`` (``during``) [``measuring``],
   scrape ``after``;
5. stop the server, always [``stopping``], and assemble the result [``done``].

Client-side metrics follow ``vllm bench serve`` (:func:`jobs.loadgen.summarize`),
server-side ones are ``/metrics`` counter deltas
(:func:`jobs.metrics.summarize_samples`). All time offsets (``start_s`` of
records, ``t_s`` of samples) are seconds since :func:`execute` began.

:func:`execute` never raises for an engine or workload problem: they become
``status="failed"`` with ``error`` carrying the engine's error lines; a set
``cancel`` event gives ``status="cancelled"``. No engine process is left
running when it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal

import httpx

from jobs import loadgen, metrics
from jobs.engine import EngineCancelledError, EngineError, EngineServer
from jobs.modelgen import load_tokenizer
from jobs.schemas import (
    ChatRequest,
    MetricSample,
    Progress,
    RequestRecord,
    RunJob,
    RunResult,
)
from jobs.workload import build_requests, request_list_hash

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[Progress], None]
Status = Literal["succeeded", "failed", "cancelled"]

_VERSION_PATTERNS = (
    re.compile(r"V1 LLM engine \(v([0-9][\w.+-]*)\)"),
    re.compile(r"vLLM API server version ([0-9][\w.+-]*)"),
    re.compile(r"\bversion ([0-9]+\.[0-9]+\.[0-9][\w.+-]*)"),
)
_KV_CACHE_RE = re.compile(
    r"(?P<dev>CPU|GPU|XPU|TPU)? ?KV cache size: (?P<tokens>[\d,]+) tokens"
    r"(?:, Maximum concurrency for (?P<len>[\d,]+) tokens per request: (?P<conc>[\d.,]+)x)?"
)


class _Cancelled(Exception):
    """Internal: the cancel event was set between steps."""


def parse_engine_log(text: str) -> dict[str, Any]:
    """Facts read from a vLLM server log (start-up lines).

    Returns a subset of: ``vllm_version`` (str), ``kv_cache_size_tokens``
    (int), ``kv_cache_max_concurrency`` (float, for ``kv_cache_max_concurrency_len``
    tokens per request), ``kv_cache_device`` (``"CPU"``/``"GPU"``...). These
    are informational; measured numbers never come from the log.
    """
    info: dict[str, Any] = {}
    for pattern in _VERSION_PATTERNS:
        if m := pattern.search(text):
            info["vllm_version"] = m.group(1)
            break
    if m := _KV_CACHE_RE.search(text):
        info["kv_cache_size_tokens"] = int(m.group("tokens").replace(",", ""))
        if m.group("dev"):
            info["kv_cache_device"] = m.group("dev")
        if m.group("conc"):
            info["kv_cache_max_concurrency"] = float(m.group("conc").replace(",", ""))
            info["kv_cache_max_concurrency_len"] = int(m.group("len").replace(",", ""))
    return info


def execute(
    job: RunJob,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> RunResult:
    """Run ``job`` end to end on this node and return its :class:`RunResult`.

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
        ``cancelled``. ``metrics``: :func:`jobs.loadgen.summarize` of the
        measured requests merged with :func:`jobs.metrics.summarize_samples`;
        ``requests``: warm-ups (``warmup=True``) then measured records;
        ``samples``: ``before`` / ``during`` / ``after`` scrapes;
        ``engine_log``: the whole server log; ``engine_info``: ``command``,
        ``port``, ``pgid`` (the server's process group, gone on return),
        ``vllm_version`` (from the log), ``startup_s``, ``request_list_hash``,
        ``prefix_cache_reset_ok``, KV cache size...;
        ``timings`` (seconds): ``startup_s``, ``warmup_s``, ``measure_s``,
        ``stop_s``, ``total_s``.

    Never raises for an engine or workload problem; the engine is stopped
    (its whole process group) before returning.
    """
    return _Run(job, progress, cancel or threading.Event()).execute()


class _Run:
    """State of one :func:`execute` call."""

    def __init__(self, job: RunJob, progress: ProgressCallback | None, cancel: threading.Event):
        self.job = job
        self.progress_cb = progress
        self.cancel = cancel
        self.t0 = time.perf_counter()
        self.records: list[RequestRecord] = []
        self.samples: list[MetricSample] = []
        self.engine_info: dict[str, Any] = {}
        self.timings: dict[str, float] = {}
        self.metrics: dict[str, float] = {}
        self.measured_total = 0
        self.measured_done = 0

    # -- helpers ------------------------------------------------------------------------

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def report(self, phase: Any, message: str = "", done: int = 0, total: int = 0) -> None:
        if self.progress_cb is None:
            return
        try:
            self.progress_cb(
                Progress(phase=phase, requests_done=done, requests_total=total, message=message)
            )
        except Exception:
            logger.exception("progress callback failed")

    def check_cancel(self) -> None:
        if self.cancel.is_set():
            raise _Cancelled()

    # -- main flow ----------------------------------------------------------------------

    def execute(self) -> RunResult:
        job = self.job
        status: Status = "succeeded"
        error: str | None = None
        server: EngineServer | None = None
        try:
            requests = build_requests(job.workload, load_tokenizer(job.launch.model_dir))
        except Exception as exc:
            logger.exception("cannot build the request list")
            return self._result("failed", f"cannot build the request list: {exc!r}", None)
        self.engine_info["request_list_hash"] = request_list_hash(requests)
        warmups = [r for r in requests if r.warmup]
        measured = [r for r in requests if not r.warmup]
        self.measured_total = len(measured)
        try:
            self.check_cancel()
            server = EngineServer(job.launch)
            self.report("starting", "launching vLLM")
            server.start()
            self.engine_info["command"] = list(server.command)
            self.engine_info["port"] = server.port
            self.engine_info["pgid"] = server.pgid
            self.report("waiting_health", f"waiting for {server.base_url}/health")
            startup_s = server.wait_healthy(self.cancel, job.launch.startup_timeout_s)
            self.timings["startup_s"] = startup_s
            self.engine_info["startup_s"] = startup_s
            self.check_cancel()
            asyncio.run(self._drive(server, warmups, measured))
            if self.cancel.is_set():
                raise _Cancelled()
            server.check_alive()
            status, error = self._judge(measured)
        except (_Cancelled, EngineCancelledError):
            status, error = "cancelled", "cancelled"
        except EngineError as exc:
            status, error = "failed", str(exc)
        except Exception as exc:
            logger.exception("run %s failed", job.run_id)
            status = "failed"
            error = f"internal error: {exc!r}\n{traceback.format_exc(limit=8)}"
            if server is not None and server.returncode is not None:
                error += "\n--- engine log (error lines) ---\n" + "\n".join(server.error_lines())
        finally:
            if server is not None:
                self.report("stopping", "stopping vLLM")
                t_stop = time.perf_counter()
                try:
                    self.engine_info["exit_code"] = server.stop()
                except EngineError as exc:  # processes survived SIGKILL: report it
                    status, error = "failed", str(exc)
                self.timings["stop_s"] = time.perf_counter() - t_stop
        return self._result(status, error, server)

    def _judge(self, measured: list[ChatRequest]) -> tuple[Status, str | None]:
        """Final verdict once the load ran: failed if nothing measured succeeded."""
        done = [r for r in self.records if not r.warmup]
        if measured and not any(r.success for r in done):
            first = next((r.error for r in done if r.error), "no measured request finished")
            return "failed", f"all {len(done)} measured requests failed; first error: {first}"
        if len(done) < len(measured):
            return "failed", f"only {len(done)} of {len(measured)} measured requests finished"
        return "succeeded", None

    def _result(self, status: Status, error: str | None, server: EngineServer | None) -> RunResult:
        engine_log = server.log_text() if server is not None else ""
        if engine_log:
            info = parse_engine_log(engine_log)
            self.engine_info = {**info, **self.engine_info}
        self.timings["total_s"] = self.now()
        self.report("done", status)
        return RunResult(
            run_id=self.job.run_id,
            status=status,
            error=error,
            metrics=self.metrics,
            requests=self.records,
            samples=self.samples,
            engine_log=engine_log,
            engine_info=self.engine_info,
            timings=self.timings,
        )

    # -- async part ---------------------------------------------------------------------

    async def _drive(
        self, server: EngineServer, warmups: list[ChatRequest], measured: list[ChatRequest]
    ) -> None:
        job = self.job
        base_url = server.base_url
        model = job.launch.served_model_name

        # Warm-up, one at a time.
        t_warm = time.perf_counter()
        if warmups:
            self.report("warmup", f"{len(warmups)} warm-up requests", 0, len(warmups))
            warm_records = await loadgen.run_load(
                base_url,
                model,
                warmups,
                concurrency=1,
                timeout_s=job.request_timeout_s,
                cancel=self.cancel,
                clock_origin=self.t0,
            )
            self.records.extend(r.model_copy(update={"warmup": True}) for r in warm_records)
        self.timings["warmup_s"] = time.perf_counter() - t_warm
        self.check_cancel()
        server.check_alive()

        # A warm cache must never leak into the measured numbers.
        reset_ok = await asyncio.to_thread(server.reset_prefix_cache)
        self.engine_info["prefix_cache_reset_ok"] = reset_ok
        apc_maybe_on = job.launch.engine_args.get("enable_prefix_caching") is not False
        if not reset_ok and warmups and apc_maybe_on:
            server.check_alive()
            raise EngineError(
                "POST /reset_prefix_cache failed after the warm-up; the measured numbers "
                "would include the warm-up's prefix cache (is VLLM_SERVER_DEV_MODE=1 set?)"
            )

        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), trust_env=False) as client:
            await self._sample(client, base_url, "before")
            stop_scraping = asyncio.Event()
            scraper = asyncio.create_task(self._scrape_loop(client, base_url, stop_scraping))
            self.report("measuring", "measured requests", 0, len(measured))
            t_measure = time.perf_counter()
            try:
                measured_records = await loadgen.run_load(
                    base_url,
                    model,
                    measured,
                    concurrency=job.workload.concurrency,
                    timeout_s=job.request_timeout_s,
                    on_record=self._on_measured_record,
                    cancel=self.cancel,
                    clock_origin=self.t0,
                )
            finally:
                measure_s = time.perf_counter() - t_measure
                self.timings["measure_s"] = measure_s
                stop_scraping.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await scraper
            await self._sample(client, base_url, "after")
        self.records.extend(measured_records)
        if measured_records and measure_s > 0:
            self.metrics.update(loadgen.summarize(measured_records, measure_s))
        self.metrics.update(metrics.summarize_samples(self.samples))

    def _on_measured_record(self, record: RequestRecord) -> None:
        self.measured_done += 1
        self.report("measuring", "", self.measured_done, self.measured_total)

    async def _sample(self, client: httpx.AsyncClient, base_url: str, phase: Any) -> None:
        """One ``/metrics`` scrape appended to ``samples``; a failure is counted, not raised."""
        t_s = self.now()
        try:
            values = await metrics.scrape(client, base_url)
        except (httpx.HTTPError, ValueError) as exc:
            errors = self.engine_info.setdefault("scrape_errors", [])
            if len(errors) < 20:
                errors.append(f"{phase} at {t_s:.1f}s: {exc!r}")
            return
        self.samples.append(MetricSample(t_s=t_s, phase=phase, values=values))

    async def _scrape_loop(
        self, client: httpx.AsyncClient, base_url: str, stop: asyncio.Event
    ) -> None:
        # One "during" sample as the load starts, then one per interval until it ends.
        interval = max(0.05, float(self.job.scrape_interval_s))
        while not stop.is_set():
            await self._sample(client, base_url, "during")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)
