"""A capacity search on a running server: the load steps of one run.

:mod:`jobs.run.runner` calls :func:`drive` for a segment whose
:attr:`~jobs.schemas.RunSegment.capacity` is set, after the segment's warm-ups, on
the server the batch already started. :class:`jobs.capacity.search.CapacitySearch` decides
each next load and plans its step (:mod:`jobs.capacity.steadystate`: how many requests, how
long, which part is warm-up); for every step this module:

1. resets the prefix cache (``reset``: the runner's ``POST /reset_prefix_cache``,
   which fails the run when a reset fails while prefix caching may be on);
2. replays **the first requests of the same request list in the same order**
   (:func:`step_requests`; the list is built once, long enough for the longest step:
   :func:`capacity_workload`, so no prompt repeats within a step) at the step's load:
   for ``request_rate`` ``plan.requests`` of them at the workload's arrival
   (``constant`` or ``poisson``, its seed) recomputed at that rate and scaled so that the
   warm-up and the measured part each offer exactly that rate
   (:func:`jobs.capacity.stepplan.scale_schedule`), in flight at most the workload's
   ``concurrency``; for ``concurrency`` a closed loop at that many requests in flight,
   dispatching for ``plan.span_s`` seconds;
3. measures it through ``measure`` (the runner's measured phase: ``before`` scrape,
   a ``/metrics`` scrape every interval, ``after`` scrape; the step is cut
   ``plan.drain_s`` after its last arrival, and the load generator's CPU time is
   measured), hands all the step's records, its server signals (:func:`step_signals`)
   and the client's CPU to the search, marks the step's warm-up records ``warmup``
   (:func:`mark_step_warmup`: excluded from the run's summary) and reports
   ``"capacity step 3: 4.2 req/s"`` then the step's verdict.

``unloaded_s`` (the warm-ups' median E2EL) and ``client_ceiling`` (req/s the load
generator sustains where it runs, when calibrated; None: unknown) go to the search.

The engine is watched as in any run: a death, an unresponsive server or a cancel
sets the runner's ``abandon`` event; the step in progress is then cut short and not
given to the search (a cut step is no measurement), and the search ends there.

**What the run keeps as its measured requests** (:func:`kept_step`): the records of
the step at the capacity, i.e. the highest-load passing step (its last measurement
when it was measured again), so the run's ordinary summary (``p99_ttft_ms``,
throughputs, server-side deltas) describes the configuration at its capacity; when no
step passed, the last step measured; when the search was cut short, the step in
progress. Every step's own percentiles, goodput and signals are in the
:class:`~jobs.capacity.search.CapacityResult`; the run's ``/metrics`` samples cover the
whole search (:func:`merge_samples`).

No I/O of its own: the runner passes the callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jobs.capacity.search import (
    CapacityResult,
    CapacitySearch,
    CapacitySpec,
    CapacityStep,
    StepSignals,
)
from jobs.capacity.steadystate import is_step_warmup, measured_wall, step_origin
from jobs.capacity.stepplan import (
    CLOSED_LOOP_REQUESTS_PER_SLOT_S,
    MAX_LIST_REQUESTS,
    StepPlan,
    min_measured,
    scale_schedule,
    unloaded_time,
)
from jobs.load.loadceiling import measure_ceiling
from jobs.load.workerplan import cores_off_engine
from jobs.load.workload import arrival_offsets
from jobs.schemas import ChatRequest, MetricSample, RequestRecord, WorkloadSpec
from jobs.signals import histograms

logger = logging.getLogger(__name__)


@dataclass
class StepMeasurement:
    """One load step as the runner measured it.

    ``duration_s``: seconds of the step's measured phase; ``samples``: its scrapes
    (``before``, ``during``..., ``after``); ``histograms``: the latency histograms of
    its ``before`` and ``after`` scrapes; ``client_cpu_s``: CPU seconds the load
    generator used during the phase, summed over its ``client_workers`` processes
    (None: not measured); ``cut``: the phase was cut at its ``cut_after_s`` limit
    (requests still in flight have no record); ``measured_s``: seconds from the first
    start to the last end of the records not marked ``warmup`` (the run's throughputs'
    time); ``step``: what the search made of it (None for a step cut short by the run's
    end); ``stalls``: the load generator's stalls (:class:`jobs.load.stalls.LoopWatch`)
    when it ran on the runner's event loop (None: in worker processes, not watched).
    """

    records: list[RequestRecord]
    duration_s: float
    samples: list[MetricSample] = field(default_factory=list)
    histograms: dict[str, dict[str, histograms.Histogram]] = field(default_factory=dict)
    load: float = 0.0
    step: CapacityStep | None = None
    client_cpu_s: float | None = None
    client_workers: int | None = None
    cut: bool = False
    measured_s: float | None = None
    stalls: list[tuple[float, float]] | None = None


@dataclass(frozen=True)
class StepLimits:
    """Time limits of one step's measured phase, seconds from its start: no dispatch
    after ``dispatch_s`` (a closed loop's length; None: the list's end), and the phase
    cut (in-flight requests aborted) at ``cut_after_s`` (None: never)."""

    dispatch_s: float | None = None
    cut_after_s: float | None = None


class PhaseCut:
    """The cancel event of a measured phase with a time limit: set when ``abandon`` is
    (the run's end), or ``cut_after_s`` seconds after :meth:`start` (then ``fired``:
    the phase was cut, its requests in flight aborted). Looked at every
    :data:`CUT_POLL_S` seconds, in the event loop."""

    def __init__(self, abandon: threading.Event, cut_after_s: float) -> None:
        self.event = threading.Event()
        self.fired = False
        self._abandon = abandon
        self._cut_after_s = cut_after_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(time.perf_counter() + self._cut_after_s))

    async def _watch(self, deadline: float) -> None:
        while not self.event.is_set():
            if self._abandon.is_set():
                self.event.set()
            elif time.perf_counter() >= deadline:
                self.fired = True
                self.event.set()
            else:
                await asyncio.sleep(CUT_POLL_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


CUT_POLL_S = 0.05
"""Seconds between two looks at a phase's time limit."""

#: ``measure(requests, concurrency, label, limits) -> StepMeasurement``: one measured
#: phase (``label``: ``"capacity step 3: 4.2 req/s"``, for progress reports).
Measure = Callable[[list[ChatRequest], int, str, StepLimits], Awaitable[StepMeasurement]]
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


def step_floor(workload: WorkloadSpec, capacity: CapacitySpec) -> int:
    """The fewest requests a step sends: ``requests_per_step`` (default the workload's
    ``num_requests``), raised to what the objectives and the steadiness test need."""
    floor = capacity.requests_per_step or workload.num_requests
    return max(floor, min_measured(capacity, capacity.needed_measured()))


def list_length(workload: WorkloadSpec, capacity: CapacitySpec) -> int:
    """Requests the run's list holds: enough for the longest step (``request_rate``: the
    floor, or ``max * max_step_s`` arrivals; ``concurrency``: sized for
    :data:`~jobs.capacity.stepplan.CLOSED_LOOP_REQUESTS_PER_SLOT_S` per slot at ``max`` for
    ``max_step_s``), at most :data:`~jobs.capacity.stepplan.MAX_LIST_REQUESTS`."""
    if capacity.variable == "concurrency":
        longest = capacity.max * capacity.max_step_s * CLOSED_LOOP_REQUESTS_PER_SLOT_S
    else:
        longest = capacity.max * capacity.max_step_s + 1
    return min(MAX_LIST_REQUESTS, max(step_floor(workload, capacity), math.ceil(longest)))


def capacity_workload(workload: WorkloadSpec, capacity: CapacitySpec) -> WorkloadSpec:
    """The workload whose request list the steps replay: ``num_requests`` is
    :func:`list_length` (kind ``replay`` keeps its bodies)."""
    if workload.kind == "replay":
        return workload
    return workload.model_copy(update={"num_requests": list_length(workload, capacity)})


def step_label(capacity: CapacitySpec, load: float) -> str:
    """``"4.2 req/s"`` or ``"concurrency 8"``."""
    if capacity.variable == "concurrency":
        return f"concurrency {round(load)}"
    return f"{load:.3g} req/s"


def step_requests(
    workload: WorkloadSpec, measured: list[ChatRequest], plan: StepPlan
) -> tuple[list[ChatRequest], int]:
    """The step's request list (the first ones of ``measured``, same order) and its
    in-flight limit.

    ``request_rate``: ``plan.requests`` requests, ``arrival_s`` from
    :func:`jobs.load.workload.arrival_offsets` of the workload at ``request_rate = load``
    (same seed: a Poisson step is the same gap pattern scaled) through
    :func:`jobs.capacity.stepplan.scale_schedule`, in flight at most ``workload.concurrency``.
    ``concurrency``: closed loop (``arrival_s`` None) over the list, ``round(load)`` in
    flight (the runner stops dispatching after ``plan.span_s``).
    """
    if plan.variable == "concurrency":
        closed = [r.model_copy(update={"arrival_s": None}) for r in measured[: plan.requests]]
        return closed, plan.in_flight
    chosen = measured[: plan.requests]
    at_rate = workload.model_copy(update={"request_rate": float(plan.load)})
    raw = [float(a or 0.0) for a in arrival_offsets(at_rate, len(chosen))]
    arrivals = scale_schedule(raw, plan)
    requests = [
        r.model_copy(update={"arrival_s": a}) for r, a in zip(chosen, arrivals, strict=True)
    ]
    return requests, workload.concurrency


def step_signals(
    samples: list[MetricSample], records: list[RequestRecord], plan: StepPlan | None = None
) -> StepSignals:
    """The server's signals of one step (the client's are derived by the search).

    ``waiting_first`` / ``waiting_last``: ``num_requests_waiting`` at the step's ``during``
    scrapes nearest the first and the last dispatch of its measured part (``plan``'s
    warm-up excluded; scrapes' ``t_s`` and records' ``start_s`` are offsets on the same
    run clock): the queue when the last request was sent, not after it drained (the last
    scrape of a step comes after the queue has emptied, so it would never show growth);
    ``waiting_max`` the most seen in the step's scrapes
    (:data:`jobs.signals.enginemetrics.SAMPLE_KEYS`);
    ``kv_cache_usage_max`` (0-1) likewise; ``preemptions``: the ``num_preemptions``
    counter's growth from the step's first scrape to its last. ``None`` where nothing
    was observed.
    """
    during = [s for s in samples if s.phase == "during"]
    queue = [
        (s.t_s, s.values["num_requests_waiting"])
        for s in during
        if "num_requests_waiting" in s.values
    ]
    waiting = [w for _, w in queue]
    kv = [s.values["kv_cache_usage"] for s in during if "kv_cache_usage" in s.values]
    preempted = [s.values["num_preemptions"] for s in samples if "num_preemptions" in s.values]
    measured = [r for r in records if not r.warmup]
    origin = step_origin(measured, plan) if plan is not None else None
    if plan is not None and origin is not None:
        measured = [r for r in measured if not is_step_warmup(r, plan, origin)]
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
        preemptions=max(0.0, preempted[-1] - preempted[0]) if len(preempted) >= 2 else None,
    )


def mark_step_warmup(records: list[RequestRecord], plan: StepPlan) -> list[RequestRecord]:
    """The step's records with those of its warm-up part marked ``warmup`` (the run's
    summary then leaves them out, as the search did)."""
    origin = step_origin(records, plan)
    if origin is None:
        return records
    return [
        r.model_copy(update={"warmup": True})
        if not r.warmup and is_step_warmup(r, plan, origin)
        else r
        for r in records
    ]


def kept_step(steps: list[StepMeasurement], cut_short: bool) -> int | None:
    """Index of the step whose records the run keeps as its measured requests.

    Cut short: the last step (the one in progress). Else the highest-load step the
    search passed (the last of equal loads: a re-measurement); none passed: the last
    step that was not ``client_limited`` (a client-limited step's numbers describe the
    load generator, not the server), else the last step. None without steps.
    """
    if not steps:
        return None
    if not cut_short:
        passed = [i for i, m in enumerate(steps) if m.step is not None and m.step.verdict == "pass"]
        if passed:
            return max(passed, key=lambda i: (steps[i].load, i))
        server = [
            i for i, m in enumerate(steps) if m.step is None or m.step.verdict != "client_limited"
        ]
        if server:
            return server[-1]
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
    unloaded_s: float | None = None,
    client_ceiling: float | None = None,
) -> SearchOutcome:
    """Run the search's steps (see the module docstring); return its outcome.

    ``measured``: the segment's measured requests (built from
    :func:`capacity_workload`); ``stopped()``: True once the runner abandoned the load
    (cancel, dead or silent engine); ``unloaded_s``: one request's time on the idle
    server (:func:`warmup_time`; None: the first step gives it); ``client_ceiling``:
    req/s the load generator sustains for this workload where it runs (None: unknown).
    Exceptions of ``measure`` and ``reset`` propagate.
    """
    search = CapacitySearch(
        capacity,
        client_ceiling=client_ceiling,
        unloaded_s=unloaded_s,
        available=len(measured),
        floor=step_floor(workload, capacity),
        in_flight=workload.concurrency,
    )
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
        plan = search.plan(load)
        requests, in_flight = step_requests(workload, measured, plan)
        closed = plan.variable == "concurrency"
        limits = StepLimits(
            dispatch_s=plan.span_s if closed else None, cut_after_s=plan.span_s + plan.drain_s
        )
        report(label)
        m = await measure(requests, in_flight, label, limits)
        m.load = load
        steps.append(m)
        if stopped():  # the step was cut short: no measurement
            cut_short = True
            break
        signals = step_signals(m.samples, m.records, plan)
        if m.client_cpu_s is not None and m.duration_s > 0:
            signals.client_cpu = m.client_cpu_s / m.duration_s
            signals.client_workers = m.client_workers or 1
        m.step = search.record(
            load, m.records, signals, m.duration_s, plan=plan, cut=m.cut, stalls=m.stalls
        )
        m.records = mark_step_warmup(m.records, plan)
        m.measured_s = measured_wall([r for r in m.records if not r.warmup])
        report(f"{label}: {m.step.verdict}")
    else:
        cut_short = True
    result = search.result()
    if cut_short:
        why = "the search was cut short (the run was cancelled or its server stopped)"
        result = result.model_copy(update={"note": f"{result.note}; {why}" if result.note else why})
    return SearchOutcome(result, steps, kept_step(steps, cut_short), cut_short)


async def calibrate_client(
    capacity: CapacitySpec, requests: list[ChatRequest], engine_binding: str | None
) -> tuple[float | None, dict[str, Any]]:
    """The load generator's ceiling for ``requests`` on this node, measured against a stub
    (:func:`jobs.load.loadceiling.measure_ceiling`, ``capacity.load_workers`` processes, off the
    engine's cores when ``engine_binding`` (``VLLM_CPU_OMP_THREADS_BIND``) names them),
    and the calibration as stored (``engine_info["client_ceiling"]``).

    The ceiling is None (unknown: each step's own watch still names a client limit) when
    no rate failed (the true ceiling is above the ramp), when the stub rather than the
    client ran out of CPU, or when the calibration could not run (its error is kept).
    """
    avoid = cores_off_engine(engine_binding)
    try:
        found = await measure_ceiling(requests, workers=capacity.load_workers, avoid_cpus=avoid)
    except Exception as exc:  # noqa: BLE001 - a calibration that cannot run is unknown
        logger.warning("load generator calibration failed: %s", exc)
        return None, {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if found.at_least or found.stub_limited:
        return None, found.model_dump(mode="json")
    return found.ceiling_rps, found.model_dump(mode="json")


def warmup_time(records: Sequence[RequestRecord]) -> float | None:
    """One request's time on the idle server: the median E2EL of the successful warm-ups
    (sent one at a time before the search)."""
    return unloaded_time([r for r in records if r.warmup], "median")
