"""One segment of a batch (one run on a possibly shared server): its state, its verdict, and
the numbers that come out of its records.

:class:`Segment` is what :mod:`jobs.run.runner` keeps per run while it drives the load
(request list, records, ``/metrics`` samples, timings, why it ended) and
:meth:`Segment.judge` is the run's verdict once the load ran. The functions derive
the result's facts from what was measured: :func:`parse_engine_log` (start-up facts
of the server log), :func:`per_class_metrics`, :func:`itl_burst_fraction`,
:func:`drop_unobserved_gauges` and :func:`thin` (the stats lines kept);
:meth:`Segment.check_cache` runs the warm-cache check (:mod:`jobs.signals.cachecheck`) of each
measured phase. No I/O.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from jobs.capacity import loadsteps
from jobs.capacity.loadsteps import SearchOutcome, StepMeasurement
from jobs.capacity.search import CapacityResult
from jobs.load import loadgen
from jobs.load.stalls import stall_metrics
from jobs.schemas import ChatRequest, MetricSample, RequestRecord, RunSegment
from jobs.signals import cachecheck, enginemetrics, histograms

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


#: Most engine stats lines kept per run (evenly thinned beyond this).
MAX_STATS_LINES = 2000


def thin(items: list[Any], limit: int = MAX_STATS_LINES) -> list[Any]:
    """``items`` if short enough, else ``limit`` of them evenly spaced (first and last kept)."""
    if len(items) <= limit:
        return items
    step = (len(items) - 1) / (limit - 1)
    return [items[round(i * step)] for i in range(limit)]


#: Gauge summaries that only mean something if a scrape saw requests in the engine.
_LOAD_GAUGES = (
    "kv_cache_usage_peak",
    "kv_cache_usage_mean",
    "num_requests_running_peak",
    "num_requests_waiting_peak",
)


def drop_unobserved_gauges(run_metrics: dict[str, float]) -> str | None:
    """Remove gauge peaks no scrape could have seen; return why, or None.

    ``/metrics`` is scraped every second; requests that all start and finish
    between two scrapes leave every sample at 0 running, so a peak of 0 would
    claim "no KV cache used" for a run that used it. When measured requests
    completed but no sample ever saw one running, the load gauges
    (:data:`_LOAD_GAUGES`) are removed from ``run_metrics`` (in place) rather
    than reported as 0.
    """
    if run_metrics.get("completed", 0) > 0 and run_metrics.get("num_requests_running_peak") == 0:
        for key in _LOAD_GAUGES:
            run_metrics.pop(key, None)
        return (
            "no /metrics scrape saw a request running (requests shorter than the scrape "
            "interval): KV cache usage and running/waiting peaks are not reported"
        )
    return None


def per_class_metrics(
    records: list[RequestRecord],
    duration_s: float,
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict[str, float]:
    """``"<class>.<metric>"`` for each request class, when a run mixes classes.

    Every :func:`jobs.load.loadgen.summarize` metric of the class's measured
    requests (latency statistics, counts, tokens, goodput with the given
    SLOs) except ``duration``; throughputs are the class's over the whole
    measured phase (``duration_s``), so the classes' throughputs add up to
    the run's. Empty when every request has the same class.
    """
    classes = sorted({r.request_class or "short" for r in records if not r.warmup})
    if len(classes) < 2:
        return {}
    out: dict[str, float] = {}
    for cls in classes:
        mine = [r for r in records if (r.request_class or "short") == cls]
        summary = loadgen.summarize(mine, duration_s, goodput_slos_ms=goodput_slos_ms)
        for key, value in summary.items():
            if key != "duration":
                out[f"{cls}.{key}"] = value
    return out


#: Inter-token gaps shorter than this arrived in one burst, not token by token.
BURST_GAP_S = 1e-4


def itl_burst_fraction(records: list[RequestRecord]) -> float | None:
    """Share of inter-token gaps under :data:`BURST_GAP_S` (0-1) over successful measured requests.

    vLLM streams one chunk per decode step; gaps of a few microseconds mean
    the chunks queued up in the server's API process (starved of CPU, e.g.
    on a 2-core host) and were flushed together, so ITL and TPOT understate
    the real decode time. None without any gap.
    """
    gaps = [g for r in records if r.success and not r.warmup for g in r.itl_s]
    if not gaps:
        return None
    return sum(1 for g in gaps if g < BURST_GAP_S) / len(gaps)


class Segment:
    """State of one run (segment) of a batch."""

    def __init__(self, seg: RunSegment, index: int, total: int) -> None:
        self.run_id = seg.run_id
        self.workload = seg.workload
        self.index = index
        self.t0 = time.perf_counter()
        self.t_end: float | None = None
        self.requests: list[ChatRequest] | None = None
        self.records: list[RequestRecord] = []
        self.samples: list[MetricSample] = []
        self.engine_info: dict[str, Any] = {"segment_index": index, "segments_total": total}
        self.timings: dict[str, float] = {}
        self.metrics: dict[str, float] = {}
        self.measured_total = 0
        self.measured_done = 0
        self.status: Status | None = None
        self.error: str | None = None
        self.engine_log = ""
        self.done_reported = False
        self.slos = dict(seg.goodput_slos_ms)
        self.stats_before = 0  # engine stats lines logged before this segment began
        self.histograms: dict[str, dict[str, histograms.Histogram]] = {}
        self.unresponsive: str | None = None  # why the server was judged unresponsive
        self.dead: str | None = None  # why the engine was seen dead during this segment
        self.dead_at: float | None = None  # seconds into the segment it was seen dead
        self.refused = False  # the server's port refused a connection
        self.capacity = seg.capacity  # a capacity search instead of one measurement
        self.capacity_result: CapacityResult | None = None
        self.capacity_succeeded = 0  # successful requests over every capacity step
        self.capacity_first_error: str | None = None
        self.step_label: str | None = None  # the capacity step being measured, for reports
        self.sample_end_s: list[float] = []  # when each scrape of ``samples`` came back
        self.last_reset_ok: bool | None = None  # the last prefix cache reset's answer
        self.cache_checks: list[dict[str, Any]] = []  # each measured phase's warm-cache check

    @property
    def partial(self) -> bool:
        """Ended early with some measured requests succeeded: what was measured is kept."""
        return self.status in ("failed", "cancelled") and any(
            r.success for r in self.records if not r.warmup
        )

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def warmups(self) -> list[ChatRequest]:
        return [r for r in self.requests or [] if r.warmup]

    @property
    def measured(self) -> list[ChatRequest]:
        return [r for r in self.requests or [] if not r.warmup]

    def judge(self, max_failed_fraction: float = 0.05) -> tuple[Status, str | None]:
        """Final verdict once the load ran on a live engine.

        Failed if nothing measured succeeded, if fewer measured requests finished
        than were planned, or if the share of failed measured requests is above
        ``max_failed_fraction`` (0-1): throughput and latencies over a run that
        lost that many requests measure the failures, not the engine.

        A run with ``duration_s`` (a time-bounded measurement) sends no measured request
        after its window closes, and the request list is only its upper bound: it is
        judged on the requests it sent in its window (each has a record: those in flight
        when the window closed finish), never against the whole list.

        A capacity search fails only if no request of any step succeeded: failed
        requests at a load above the capacity are what the search measures (its steps
        count them and stop at saturation), not a broken run.
        """
        if self.capacity is not None:
            if self.capacity_result is None or not self.capacity_result.steps:
                return "failed", "the capacity search measured no step"
            if self.capacity_succeeded == 0:
                first = self.capacity_first_error or "no measured request finished"
                return "failed", f"no request of any capacity step succeeded; first error: {first}"
            return "succeeded", None
        measured = self.measured
        done = [r for r in self.records if not r.warmup]
        if measured and not any(r.success for r in done):
            first = next((r.error for r in done if r.error), "no measured request finished")
            return "failed", f"all {len(done)} measured requests failed; first error: {first}"
        if self.workload.duration_s is None and len(done) < len(measured):
            return "failed", f"only {len(done)} of {len(measured)} measured requests finished"
        failed = [r for r in done if not r.success]
        if done and len(failed) / len(done) > max_failed_fraction:
            first = next((r.error for r in failed if r.error), "?")
            return "failed", (
                f"{len(failed)} of {len(done)} measured requests failed "
                f"({len(failed) / len(done):.1%}, above the {max_failed_fraction:.1%} allowed: "
                "VLAB_ENGINE__MAX_FAILED_REQUEST_FRACTION); the numbers are not a valid "
                f"measurement; first error: {first}"
            )
        return "succeeded", None

    def summarize(self, step: StepMeasurement) -> None:
        """The run's metrics from one measured phase: client-side (``vllm bench serve``'s
        definitions, per class, ITL bursts), ``/metrics`` deltas and gauges over the
        phase's scrapes, and the latency-histogram deltas between its ``before`` and
        ``after`` scrapes."""
        records, measure_s = step.records, step.measured_s or step.duration_s
        if records and measure_s > 0:
            self.metrics.update(loadgen.summarize(records, measure_s, goodput_slos_ms=self.slos))
            self.metrics.update(per_class_metrics(records, measure_s, self.slos))
            burst = itl_burst_fraction(records)
            if burst is not None:
                self.metrics["itl_burst_fraction"] = burst
            if step.stalls is not None:
                self.metrics.update(stall_metrics(step.stalls, records))
        counter_notes: list[str] = []
        self.metrics.update(enginemetrics.summarize_samples(step.samples, counter_notes))
        if counter_notes:
            self.engine_info["counter_notes"] = counter_notes
        note = drop_unobserved_gauges(self.metrics)
        if note:
            self.engine_info["gauges_not_observed"] = note
        before, after = step.histograms.get("before"), step.histograms.get("after")
        if before is not None and after is not None:
            server_view, notes = histograms.summarize_histograms(before, after)
            self.metrics.update(server_view)
            # Cross-check of the same requests seen from both ends: vLLM's TTFT histogram
            # starts when the engine got the request (after HTTP parsing, chat template and
            # tokenization in the API process); the client's also covers those and SSE.
            if "server_mean_ttft_ms" in server_view and "mean_ttft_ms" in self.metrics:
                self.metrics["mean_ttft_client_minus_server_ms"] = (
                    self.metrics["mean_ttft_ms"] - server_view["server_mean_ttft_ms"]
                )
            if notes:
                self.engine_info["histogram_notes"] = notes

    def check_cache(
        self, records: list[RequestRecord], first_sample: int, engine_args: dict[str, Any]
    ) -> None:
        """The warm-cache check of the measured phase whose scrapes start at
        ``samples[first_sample]`` (:func:`jobs.signals.cachecheck.check`), combined with the run's
        earlier phases into ``engine_info["cache_contamination"]``.

        The server is known to report cached tokens when ``engine_args`` set
        ``enable_prompt_tokens_details`` or any record of the run carries a value;
        prefix caching is off when ``engine_args["enable_prefix_caching"] is False``.
        """
        phase = self.samples[first_sample:]
        ends = self.sample_end_s[first_sample:]
        before = phase[0] if phase and phase[0].phase == "before" else None
        scrapes = [
            cachecheck.Scrape(s, end)
            for s, end in zip(phase, ends, strict=True)
            if s.phase != "before"
        ]
        reports = bool(engine_args.get("enable_prompt_tokens_details")) or any(
            r.cached_tokens is not None for r in [*self.records, *records]
        )
        self.cache_checks.append(
            cachecheck.check(
                records,
                before,
                scrapes,
                prefix_caching_off=engine_args.get("enable_prefix_caching") is False,
                reports_cached_tokens=reports,
                reset_ok=self.last_reset_ok,
            )
        )
        self.last_reset_ok = None
        self.engine_info["cache_contamination"] = cachecheck.combine(self.cache_checks)

    def keep_capacity(self, outcome: SearchOutcome) -> None:
        """Take a capacity search's outcome as the run's result: the search's result,
        the kept step's records as the measured requests and its numbers as the run's
        metrics (:func:`jobs.capacity.loadsteps.kept_step`), plus ``capacity``,
        ``capacity_low``, ``capacity_high`` when the search found the boundary and was
        not cut short; ``measure_s`` is the whole search's; the samples cover it all
        (:func:`jobs.capacity.loadsteps.merge_samples`). ``engine_info``:
        ``capacity_steps`` (steps measured), ``capacity_kept_step`` (0-based)."""
        self.capacity_result = outcome.result
        done = [r for m in outcome.steps for r in m.records if not r.warmup]
        self.capacity_succeeded = sum(1 for r in done if r.success)
        self.capacity_first_error = next((r.error for r in done if r.error), None)
        self.timings["measure_s"] = sum(m.duration_s for m in outcome.steps)
        self.engine_info["capacity_steps"] = len(outcome.steps)
        self.samples = loadsteps.merge_samples(self.samples)
        if outcome.kept is None:
            return
        kept = outcome.steps[outcome.kept]
        self.engine_info["capacity_kept_step"] = outcome.kept
        self.records.extend(kept.records)
        self.measured_total = len(kept.records)
        self.summarize(kept)
        if not outcome.cut_short:
            self.metrics.update(loadsteps.capacity_metrics(outcome.result))
