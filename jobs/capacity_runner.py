"""A capacity search on a running server: the load steps of one run.

:mod:`jobs.runner` calls :func:`drive` for a segment whose
:attr:`~jobs.schemas.RunSegment.capacity` is set, after the segment's warm-ups, on
the server the batch already started. :class:`jobs.capacity.CapacitySearch` decides
each next load; for every step this module:

1. resets the prefix cache (``reset``: the runner's ``POST /reset_prefix_cache``,
   which fails the run when a reset fails while prefix caching may be on);
2. replays **the same request list in the same order** (:func:`step_requests`: the
   segment's measured requests, ``capacity.requests_per_step`` of them when set,
   see :func:`capacity_workload`) at the step's load: for ``request_rate`` the
   workload's arrival (``constant`` or ``poisson``, its seed) recomputed at that rate,
   in flight at most the workload's ``concurrency``; for ``concurrency`` a closed loop
   at that many requests in flight;
3. measures it through ``measure`` (the runner's measured phase: ``before`` scrape,
   a ``/metrics`` scrape every interval, ``after`` scrape), hands the step's records
   and its server signals (:func:`step_signals`) to the search, and reports
   ``"capacity step 3: 4.2 req/s"`` then the step's verdict.

The engine is watched as in any run: a death, an unresponsive server or a cancel
sets the runner's ``abandon`` event; the step in progress is then cut short and not
given to the search (a cut step is no measurement), and the search ends there.

**What the run keeps as its measured requests** (:func:`kept_step`): the records of
the step at the capacity, i.e. the highest-load passing step (its last measurement
when it was measured again), so the run's ordinary summary (``p99_ttft_ms``,
throughputs, server-side deltas) describes the configuration at its capacity; when no
step passed, the last step measured; when the search was cut short, the step in
progress. Every step's own percentiles, goodput and signals are in the
:class:`~jobs.capacity.CapacityResult`; the run's ``/metrics`` samples cover the
whole search (:func:`merge_samples`).

No I/O of its own: the runner passes the callbacks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from jobs import metrics
from jobs.capacity import CapacityResult, CapacitySearch, CapacitySpec, CapacityStep, StepSignals
from jobs.schemas import ChatRequest, MetricSample, RequestRecord, WorkloadSpec
from jobs.workload import arrival_offsets


@dataclass
class StepMeasurement:
    """One load step as the runner measured it.

    ``duration_s``: seconds of the step's measured phase; ``samples``: its scrapes
    (``before``, ``during``..., ``after``); ``histograms``: the latency histograms of
    its ``before`` and ``after`` scrapes; ``step``: what the search made of it (None
    for a step cut short).
    """

    records: list[RequestRecord]
    duration_s: float
    samples: list[MetricSample] = field(default_factory=list)
    histograms: dict[str, dict[str, metrics.Histogram]] = field(default_factory=dict)
    load: float = 0.0
    step: CapacityStep | None = None


#: ``measure(requests, concurrency, label) -> StepMeasurement``: one measured phase
#: (``label``: ``"capacity step 3: 4.2 req/s"``, for progress reports).
Measure = Callable[[list[ChatRequest], int, str], Awaitable[StepMeasurement]]
#: ``reset(step_number)``: reset the prefix cache before a step (raises to end the run).
Reset = Callable[[int], Awaitable[None]]


@dataclass
class SearchOutcome:
    """What :func:`drive` returns: the search's result, every step measured (the cut one
    too), the index in ``steps`` of the step whose records the run keeps, and whether
    the search was cut short."""

    result: CapacityResult
    steps: list[StepMeasurement]
    kept: int | None
    cut_short: bool


def capacity_workload(workload: WorkloadSpec, capacity: CapacitySpec) -> WorkloadSpec:
    """The workload whose request list the steps replay: ``num_requests`` is
    ``capacity.requests_per_step`` when set (kind ``replay`` keeps its bodies)."""
    if capacity.requests_per_step is None or workload.kind == "replay":
        return workload
    return workload.model_copy(update={"num_requests": capacity.requests_per_step})


def step_label(capacity: CapacitySpec, load: float) -> str:
    """``"4.2 req/s"`` or ``"concurrency 8"``."""
    if capacity.variable == "concurrency":
        return f"concurrency {round(load)}"
    return f"{load:.3g} req/s"


def step_requests(
    capacity: CapacitySpec, workload: WorkloadSpec, measured: list[ChatRequest], load: float
) -> tuple[list[ChatRequest], int]:
    """The step's request list (same requests, same order) and its in-flight limit.

    ``request_rate``: ``arrival_s`` from :func:`jobs.workload.arrival_offsets` of the
    workload at ``request_rate = load`` (same seed: a Poisson step is the same gap
    pattern scaled), in flight at most ``workload.concurrency``. ``concurrency``:
    closed loop (``arrival_s`` None) with ``round(load)`` in flight.
    """
    if capacity.variable == "concurrency":
        return [r.model_copy(update={"arrival_s": None}) for r in measured], max(1, round(load))
    at_rate = workload.model_copy(update={"request_rate": float(load)})
    arrivals = arrival_offsets(at_rate, len(measured))
    requests = [
        r.model_copy(update={"arrival_s": a}) for r, a in zip(measured, arrivals, strict=True)
    ]
    return requests, workload.concurrency


def step_signals(samples: list[MetricSample], records: list[RequestRecord]) -> StepSignals:
    """The server and client signals of one step.

    ``waiting_first`` / ``waiting_last``: ``num_requests_waiting`` at the step's ``during``
    scrapes nearest its first and its last dispatch (scrapes' ``t_s`` and records'
    ``start_s`` are offsets on the same run clock): the queue when the last request was
    sent, not after it drained (the last scrape of a step comes after the queue has
    emptied, so it would never show growth); ``waiting_max`` the most seen in the step's
    scrapes (:data:`jobs.metrics.SAMPLE_KEYS`); ``kv_cache_usage_max``
    (0-1) likewise; ``dispatch_lag_p99_ms``: p99 (linear interpolation) of ``start_s -
    scheduled_s`` over the open-loop records, in ms. ``None`` where nothing was observed.
    """
    during = [s for s in samples if s.phase == "during"]
    queue = [
        (s.t_s, s.values["num_requests_waiting"])
        for s in during
        if "num_requests_waiting" in s.values
    ]
    waiting = [w for _, w in queue]
    kv = [s.values["kv_cache_usage"] for s in during if "kv_cache_usage" in s.values]
    measured = [r for r in records if not r.warmup]
    lags = [(r.start_s - r.scheduled_s) * 1000.0 for r in measured if r.scheduled_s is not None]
    first_t = min((r.start_s for r in measured), default=None)
    last_t = max((r.start_s for r in measured), default=None)

    def nearest(t: float | None, fallback: float | None) -> float | None:
        if not queue:
            return None
        if t is None:
            return fallback
        return min(queue, key=lambda sample: abs(sample[0] - t))[1]

    return StepSignals(
        waiting_first=nearest(first_t, waiting[0] if waiting else None),
        waiting_last=nearest(last_t, waiting[-1] if waiting else None),
        waiting_max=max(waiting) if waiting else None,
        kv_cache_usage_max=max(kv) if kv else None,
        dispatch_lag_p99_ms=float(np.percentile(lags, 99)) if lags else None,
    )


def kept_step(steps: list[StepMeasurement], cut_short: bool) -> int | None:
    """Index of the step whose records the run keeps as its measured requests.

    Cut short: the last step (the one in progress). Else the highest-load step the
    search passed (the last of equal loads: a re-measurement); none passed: the last
    step. None without steps.
    """
    if not steps:
        return None
    if not cut_short:
        passed = [i for i, m in enumerate(steps) if m.step is not None and m.step.verdict == "pass"]
        if passed:
            return max(passed, key=lambda i: (steps[i].load, i))
    return len(steps) - 1


def merge_samples(samples: list[MetricSample]) -> list[MetricSample]:
    """The whole search's scrapes as one run's: the first ``before`` and the last
    ``after`` keep their phase, every other scrape (the steps' own ``before`` and
    ``after`` in between) becomes ``during``, so the run's time series shows the search
    in order with one ``before`` and one ``after``."""
    out: list[MetricSample] = []
    last = len(samples) - 1
    for i, s in enumerate(samples):
        keep = (i == 0 and s.phase == "before") or (i == last and s.phase == "after")
        out.append(s if keep or s.phase == "during" else s.model_copy(update={"phase": "during"}))
    return out


def capacity_metrics(result: CapacityResult | None) -> dict[str, float]:
    """The run's summary metrics of a search: ``capacity`` (the boundary, in the
    variable's unit: requests/s or requests in flight), ``capacity_low`` and
    ``capacity_high`` (the bracket: highest passing, lowest failing load). Only for
    status ``found``; otherwise {} (unknown, never a guess; the result says why)."""
    if result is None or result.status != "found" or result.capacity is None:
        return {}
    out = {"capacity": float(result.capacity)}
    low, high = result.interval
    if low is not None:
        out["capacity_low"] = float(low)
    if high is not None:
        out["capacity_high"] = float(high)
    return out


async def drive(
    capacity: CapacitySpec,
    workload: WorkloadSpec,
    measured: list[ChatRequest],
    *,
    measure: Measure,
    reset: Reset,
    report: Callable[[str], None],
    stopped: Callable[[], bool],
) -> SearchOutcome:
    """Run the search's steps (see the module docstring); return its outcome.

    ``measured``: the segment's measured requests (built from
    :func:`capacity_workload`); ``stopped()``: True once the runner abandoned the load
    (cancel, dead or silent engine). Exceptions of ``measure`` and ``reset`` propagate.
    """
    search = CapacitySearch(capacity)
    steps: list[StepMeasurement] = []
    cut_short = False
    while not stopped():
        load = search.next_load()
        if load is None:
            break
        number = len(steps) + 1
        label = f"capacity step {number}: {step_label(capacity, load)}"
        await reset(number)
        if stopped():
            cut_short = True
            break
        requests, in_flight = step_requests(capacity, workload, measured, load)
        report(label)
        m = await measure(requests, in_flight, label)
        m.load = load
        steps.append(m)
        if stopped():  # the step was cut short: no measurement
            cut_short = True
            break
        m.step = search.record(load, m.records, step_signals(m.samples, m.records), m.duration_s)
        report(f"{label}: {m.step.verdict}")
    else:
        cut_short = True
    result = search.result()
    if cut_short:
        why = "the search was cut short (the run was cancelled or its server stopped)"
        result = result.model_copy(update={"note": f"{result.note}; {why}" if result.note else why})
    return SearchOutcome(result, steps, kept_step(steps, cut_short), cut_short)
