"""One segment driven on a running server: the async part of :mod:`jobs.run.runner`.

Warm-up, prefix-cache reset, the measured phase (or the capacity search's steps) with
``/metrics`` scraped before, during and after, while the engine's processes are
watched for death and hangs (steps 3a-3c of :func:`jobs.run.runner.execute_batch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from jobs.capacity import loadsteps
from jobs.capacity.loadsteps import PhaseCut, StepLimits, StepMeasurement
from jobs.engine.server import EngineError, EngineServer
from jobs.load import loadgen
from jobs.load.loadpool import run_load_workers
from jobs.load.stalls import LoopWatch
from jobs.load.workerplan import cores_off_engine
from jobs.run import enginewatch, journal
from jobs.run.segment import Segment
from jobs.schemas import BatchJob, ChatRequest, MetricSample, RequestRecord
from jobs.signals import enginemetrics, histograms

__all__ = ["ENGINE_WATCH_INTERVAL_S", "Batch", "drive"]

logger = logging.getLogger(__name__)

_SCRAPE_TIMEOUT_S = 10.0
#: Seconds between two looks at the engine's processes while a segment runs.
ENGINE_WATCH_INTERVAL_S = 0.1
#: After a refused ``POST /reset_prefix_cache``: how long to wait for the engine's death
#: before the refusal is taken for what it says (vLLM's processes exit within a second or
#: two of their engine core's fatal error).
RESET_DEATH_WAIT_S = 3.0


class Batch(Protocol):
    """What a segment's drive needs of its batch (:class:`jobs.run.runner._Batch`)."""

    job: BatchJob
    journal: journal.Journal
    telemetry: Callable[[], dict[str, float]] | None
    cancel: threading.Event

    def report(
        self,
        seg: Segment | None,
        phase: Any,
        message: str = "",
        done: int | None = None,
        total: int | None = None,
    ) -> None: ...

    def check_cancel(self) -> None: ...

    def raise_if_dead(self, server: EngineServer, seg: Segment, wait_s: float = 0.0) -> None: ...


async def drive(batch: Batch, server: EngineServer, seg: Segment, reused: bool) -> None:
    """Drive ``seg`` on ``server`` (``reused``: an earlier segment ran on it)."""
    await _Drive(batch).run(server, seg, reused)


class _Drive:
    """One segment's drive: its batch, and the hang watch of its engine."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.hang: enginewatch.HangWatch | None = None

    async def run(self, server: EngineServer, seg: Segment, reused: bool) -> None:
        # set on cancel, on the engine's death (the watcher), when the port refuses a
        # connection (stop_when) or when the server stops answering (the scraper): the
        # load in progress stops at once with what was measured
        abandon = threading.Event()
        watcher = asyncio.create_task(self._watch(server, seg, abandon))
        try:
            await self._drive_load(server, seg, reused, abandon)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _drive_load(
        self, server: EngineServer, seg: Segment, reused: bool, abandon: threading.Event
    ) -> None:
        job = self.batch.job
        base_url = server.base_url
        model = job.launch.served_model_name
        warmups, measured = seg.warmups, seg.measured

        def stop_when(record: RequestRecord) -> bool:
            if loadgen.refused(record):
                seg.refused = True
                abandon.set()
            return seg.refused

        # Warm-up, one at a time.
        t_warm = time.perf_counter()
        if warmups:
            self.batch.report(seg, "warmup", f"{len(warmups)} warm-up requests", 0, len(warmups))
            warm_records = await loadgen.run_load(
                base_url,
                model,
                warmups,
                concurrency=1,
                timeout_s=job.request_timeout_s,
                on_record=lambda record: self._stream(seg, record),
                cancel=abandon,
                clock_origin=seg.t0,
                stop_when=stop_when,
            )
            seg.records.extend(r.model_copy(update={"warmup": True}) for r in warm_records)
        seg.timings["warmup_s"] = time.perf_counter() - t_warm
        self.batch.check_cancel()
        self.batch.raise_if_dead(server, seg)
        if seg.unresponsive is not None:
            return  # hung in the warm-up

        if seg.capacity is not None:
            await self._drive_capacity(server, seg, reused, abandon, stop_when)
            return
        what = "an earlier run's" if reused else "the warm-up's"
        await self._reset_cache(server, seg, bool(warmups or reused), what)
        step = await self._measure(
            server, seg, measured, seg.workload.concurrency, abandon, stop_when, "measured requests"
        )
        seg.records.extend(step.records)
        seg.timings["measure_s"] = step.duration_s
        seg.summarize(step)

    async def _reset_cache(
        self, server: EngineServer, seg: Segment, something_cached: bool, what: str
    ) -> None:
        """``POST /reset_prefix_cache`` before measured requests: a warm cache (the
        warm-up's, an earlier run's on a reused server, an earlier capacity step's) must
        never leak into the measured numbers. ``engine_info["prefix_cache_reset_ok"]``:
        every reset of the run worked. A failed reset raises :class:`EngineError` when
        there was ``something_cached`` and prefix caching may be on."""
        reset_ok = await asyncio.to_thread(server.reset_prefix_cache)
        seg.last_reset_ok = reset_ok
        seg.engine_info["prefix_cache_reset_ok"] = (
            seg.engine_info.get("prefix_cache_reset_ok", True) and reset_ok
        )
        apc_maybe_on = self.batch.job.launch.engine_args.get("enable_prefix_caching") is not False
        if not reset_ok and something_cached and apc_maybe_on:
            # an engine that died in the warm-up (its engine core's fatal error) refuses
            # the reset too, before its processes are seen gone: that is its death, not a
            # missing dev mode, so give the death a moment to show
            self.batch.raise_if_dead(server, seg, wait_s=RESET_DEATH_WAIT_S)
            raise EngineError(
                "POST /reset_prefix_cache failed before the measured requests; the measured "
                f"numbers would include {what} prefix cache (is VLLM_SERVER_DEV_MODE=1 set?)"
            )

    async def _measure(
        self,
        server: EngineServer,
        seg: Segment,
        requests: list[ChatRequest],
        concurrency: int,
        abandon: threading.Event,
        stop_when: Callable[[RequestRecord], bool],
        message: str,
        limits: StepLimits | None = None,
    ) -> StepMeasurement:
        """One measured phase: scrape ``before``, drive ``requests`` while a background
        task scrapes every interval (``during``), scrape ``after``. The scrapes are
        appended to ``seg.samples`` too; then the phase's warm-cache check
        (:meth:`Segment.check_cache`). ``limits``: a capacity step's dispatch length and
        cut (:class:`~jobs.capacity.loadsteps.PhaseCut`); the load generator's CPU time (its
        event-loop thread) is measured."""
        limits = limits or StepLimits()
        cut = PhaseCut(abandon, limits.cut_after_s) if limits.cut_after_s else None
        seg.measured_done, seg.measured_total = 0, len(requests)
        first_sample = len(seg.samples)
        seg.histograms = {}
        base_url = server.base_url
        timeout = httpx.Timeout(_SCRAPE_TIMEOUT_S)
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            await self._sample(client, base_url, seg, "before")
            stop_scraping = asyncio.Event()
            scraper = asyncio.create_task(self._scrape_loop(client, base_url, seg, stop_scraping))
            self.batch.report(seg, "measuring", message, 0, len(requests))
            t_measure, cpu = time.perf_counter(), time.thread_time()
            workers = seg.capacity.load_workers if seg.capacity is not None else 1
            binding = self.batch.job.launch.env.get("VLLM_CPU_OMP_THREADS_BIND")
            # one worker runs the load on this event loop: watch it for stalls
            loop_watch = LoopWatch(seg.t0) if workers == 1 else None
            watching = asyncio.create_task(loop_watch.run()) if loop_watch else None
            try:  # one process (in this one) or several, off the engine's cores when known
                pooled = await run_load_workers(
                    base_url,
                    self.batch.job.launch.served_model_name,
                    requests,
                    workers=workers,
                    avoid_cpus=cores_off_engine(binding) if workers > 1 else None,
                    concurrency=concurrency,
                    timeout_s=self.batch.job.request_timeout_s,
                    on_record=lambda record: self._on_measured_record(seg, record),
                    cancel=cut.event if cut is not None else abandon,
                    clock_origin=seg.t0,
                    duration_s=limits.dispatch_s or seg.workload.duration_s,
                    stop_when=stop_when,
                    on_start=cut.start if cut is not None else None,  # after the workers' start-up
                )
                records = pooled.records
            finally:
                measure_s, cpu = time.perf_counter() - t_measure, time.thread_time() - cpu
                if watching is not None:
                    watching.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watching
                if cut is not None:
                    await cut.stop()
                stop_scraping.set()
                if abandon.is_set():  # a scrape of a hung server would take its timeout
                    scraper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await scraper
            if seg.unresponsive is None and seg.dead is None and not seg.refused:
                await self._sample(client, base_url, seg, "after")
        seg.check_cache(records, first_sample, self.batch.job.launch.engine_args)
        step = StepMeasurement(records, measure_s, seg.samples[first_sample:], dict(seg.histograms))
        if not pooled.in_process:  # in this process: the event loop's thread only
            cpu = pooled.client_cpu_s
        step.client_cpu_s, step.client_workers = cpu, len(pooled.workers) or 1
        step.cut = cut is not None and cut.fired
        step.stalls = loop_watch.stalls if loop_watch is not None and pooled.in_process else None
        return step

    async def _drive_capacity(
        self,
        server: EngineServer,
        seg: Segment,
        reused: bool,
        abandon: threading.Event,
        stop_when: Callable[[RequestRecord], bool],
    ) -> None:
        """The capacity search's steps (:func:`jobs.capacity.loadsteps.drive`); the run keeps
        the records of :func:`jobs.capacity.loadsteps.kept_step` as its measured requests."""
        assert seg.capacity is not None

        async def reset(number: int) -> None:
            if number == 1:
                what = "an earlier run's" if reused else "the warm-up's"
                await self._reset_cache(server, seg, bool(seg.warmups or reused), what)
            else:
                await self._reset_cache(server, seg, True, "the previous capacity step's")

        async def measure(
            requests: list[ChatRequest], in_flight: int, label: str, limits: StepLimits
        ) -> StepMeasurement:
            seg.step_label = label  # every report of the step says which step it is
            return await self._measure(
                server, seg, requests, in_flight, abandon, stop_when, label, limits
            )

        outcome = await loadsteps.drive(
            seg.capacity,
            seg.workload,
            seg.measured,
            measure=measure,
            reset=reset,
            report=lambda message: self.batch.report(seg, "measuring", message),
            stopped=abandon.is_set,
            unloaded_s=loadsteps.warmup_time(seg.records),
            client_ceiling=await self._client_ceiling(seg),
        )
        seg.keep_capacity(outcome)

    async def _client_ceiling(self, seg: Segment) -> float | None:
        """The load generator's ceiling here (:func:`jobs.capacity.loadsteps.calibrate_client`),
        kept in ``engine_info["client_ceiling"]``."""
        assert seg.capacity is not None
        if not seg.capacity.calibrates:
            return None
        self.batch.report(seg, "measuring", "calibrating the load generator against a stub server")
        binding = self.batch.job.launch.env.get("VLLM_CPU_OMP_THREADS_BIND")
        ceiling, seg.engine_info["client_ceiling"] = await loadsteps.calibrate_client(
            seg.capacity, seg.measured, binding
        )
        return ceiling

    async def _watch(self, server: EngineServer, seg: Segment, abandon: threading.Event) -> None:
        """Set ``abandon`` on the batch's cancel, when a process of the engine is gone
        (:meth:`EngineServer.death`) or when the engine hung (:class:`jobs.run.enginewatch.
        HangWatch`, probing meanwhile); checked every :data:`ENGINE_WATCH_INTERVAL_S` s."""
        hang = self.hang = enginewatch.HangWatch(server.base_url, stopped=server.stopped_processes)
        prober = asyncio.create_task(hang.probe())
        try:
            while not abandon.is_set():
                if self.batch.cancel.is_set():
                    abandon.set()
                    return
                reason = server.death()
                hung = hang.verdict() if reason is None else None
                if reason is not None or hung is not None:
                    seg.dead, seg.unresponsive, seg.dead_at = reason, hung, seg.now()
                    if hung is not None:
                        server.mark_hung(hung)
                    logger.warning("run %s: %s", seg.run_id, reason or hung)
                    abandon.set()
                    return
                await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
        finally:
            prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await prober

    def _stream(self, seg: Segment, record: RequestRecord) -> None:
        """Journal a finished request's record and hand it to ``on_record`` (never raises)."""
        self.batch.journal.record(seg.run_id, record)

    def _on_measured_record(self, seg: Segment, record: RequestRecord) -> None:
        seg.measured_done += 1
        if record.success and self.hang is not None:
            self.hang.life()  # a load worker's request finished (bytes of this process: sseclient)
        self._stream(seg, record)
        self.batch.report(
            seg, "measuring", seg.step_label or "", seg.measured_done, seg.measured_total
        )

    async def _sample(
        self, client: httpx.AsyncClient, base_url: str, seg: Segment, phase: Any
    ) -> bool:
        """One ``/metrics`` scrape appended to ``seg.samples``; True if it worked.

        A failure is counted in ``engine_info["scrape_errors"]``, not raised. The
        ``before`` and ``after`` scrapes also keep the latency histograms.
        """
        t_s = seg.now()
        try:
            resp = await client.get(base_url.rstrip("/") + enginemetrics.METRICS_PATH)
            t_end = seg.now()  # the server rendered the text before this
            resp.raise_for_status()
            values = enginemetrics.parse_metrics(resp.text)
            if phase in ("before", "after"):
                seg.histograms[phase] = histograms.parse_histograms(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            errors = seg.engine_info.setdefault("scrape_errors", [])
            if len(errors) < 20:
                errors.append(f"{phase} at {t_s:.1f}s: {exc!r}")
            return False
        if self.batch.telemetry is not None:
            try:
                values.update(await asyncio.to_thread(self.batch.telemetry))
            except Exception as exc:  # noqa: BLE001 - telemetry never ends a run
                errors = seg.engine_info.setdefault("telemetry_errors", [])
                if len(errors) < 20:
                    errors.append(f"{phase} at {t_s:.1f}s: {exc!r}")
        sample = MetricSample(t_s=t_s, phase=phase, values=values)
        seg.samples.append(self.batch.journal.sample(seg.run_id, sample))
        seg.sample_end_s.append(t_end)
        if self.hang is not None:
            self.hang.life()
        return True

    async def _scrape_loop(
        self, client: httpx.AsyncClient, base_url: str, seg: Segment, stop: asyncio.Event
    ) -> None:
        """One ``during`` sample as the load starts, then one per interval until it ends
        (a server that stops answering is :class:`jobs.run.enginewatch.HangWatch`'s to judge)."""
        interval = max(0.05, float(self.batch.job.scrape_interval_s))
        while not stop.is_set():
            await self._sample(client, base_url, seg, "during")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)
