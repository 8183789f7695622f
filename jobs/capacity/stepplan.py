"""How long a capacity step lasts and what it sends: :mod:`jobs.capacity.steadystate` reads
its records. Pure: no I/O, no clock.

**Planning a step** (:func:`plan_step`). A step at load ``L`` lasts ``d = max(min_step_s,
step_time_factor * unloaded_s)``, at most ``max_step_s`` (``unloaded_s``: the time one
request takes on an idle server: the warm-ups' median E2EL, then the smallest E2EL of
the first step, whose first request finds the server empty; unknown: ``min_step_s``).
For ``request_rate`` it sends ``n = max(floor, ceil(L * d))`` requests (``floor``:
``requests_per_step``, and enough measured requests for the objectives' percentiles and
for the steadiness test) at rate ``L``: the first ``n`` of the run's request list, the
same requests in the same order at every step. Its first ``ceil(warmup_fraction * n)``
requests are the warm-up, excluded from every decision (their records stay in the
step, marked ``warmup``). The arrival pattern (constant, or the workload's seeded
Poisson/gamma gaps) is scaled piecewise so that the warm-up part and the measured part
each offer exactly rate ``L`` (:func:`scale_schedule`: a Poisson process conditioned on
its count): the measured part asks for the step's load, not a random draw around it.
For ``concurrency`` the step dispatches for ``d`` seconds (closed loop) and its first
``warmup_fraction * d`` seconds are the warm-up. A step whose requests are still
unfinished ``drain_s = max(spec.drain_s(), 4 * unloaded_s)`` after its last arrival is cut
there: the server had not finished them (saturation evidence).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:  # jobs.capacity.search imports this module
    from jobs.capacity.search import CapacitySpec
    from jobs.schemas import RequestRecord

__all__ = [
    "CLOSED_LOOP_REQUESTS_PER_SLOT_S",
    "DRAIN_REQUEST_TIMES",
    "MAX_LIST_REQUESTS",
    "StepPlan",
    "min_measured",
    "plan_step",
    "scale_schedule",
    "unloaded_time",
]

DRAIN_REQUEST_TIMES = 4.0
"""A step's drain limit is at least this many unloaded request times."""

MAX_LIST_REQUESTS = 20_000
"""Most requests a capacity run's request list holds (``WorkloadSpec.num_requests``)."""

CLOSED_LOOP_REQUESTS_PER_SLOT_S = 10.0
"""Requests per second per in-flight slot a concurrency step's list is sized for."""


@dataclass(frozen=True)
class StepPlan:
    """How one step is driven (see the module docstring).

    ``requests``: open loop, the first ``requests`` of the list are sent; closed loop,
    the most it may send. ``span_s``: open loop, the planned time from the first to the
    last arrival; closed loop, how long it dispatches. ``warmup_requests`` (open loop)
    and ``warmup_s`` (from the first arrival or dispatch): the warm-up part.
    ``drain_s``: how long after the last arrival the step may run before it is cut.
    ``in_flight``: the in-flight cap. ``short``: why the step cannot last as long as a
    steady state needs (None: it can).
    """

    load: float
    variable: Literal["request_rate", "concurrency"]
    requests: int
    span_s: float
    warmup_requests: int
    warmup_s: float
    drain_s: float
    in_flight: int
    unloaded_s: float | None = None
    short: str | None = None


def unloaded_time(records: Sequence[RequestRecord], how: Literal["median", "min"]) -> float | None:
    """The E2EL (s) of the successful records: their median (the warm-ups, sent one at a
    time) or their minimum (a step's: its first request finds the server idle)."""
    e2el = [
        r.e2el_s
        for r in records
        if r.success and r.e2el_s is not None and math.isfinite(r.e2el_s) and r.e2el_s > 0
    ]
    if not e2el:
        return None
    return float(np.median(e2el)) if how == "median" else min(e2el)


def min_measured(spec: CapacitySpec, need: int) -> int:
    """Requests a step sends at least so that ``need`` of them are measured."""
    return math.ceil(need / (1.0 - spec.warmup_fraction)) + 1


def plan_step(
    spec: CapacitySpec,
    load: float,
    *,
    unloaded_s: float | None,
    available: int | None,
    floor: int,
    in_flight: int,
) -> StepPlan:
    """The plan of a step at ``load`` (rules in the module docstring).

    ``available``: requests in the run's list (None: unlimited); ``floor``: the fewest
    requests a step sends; ``in_flight``: the open loop's in-flight cap.
    """
    wanted = max(spec.min_step_s, spec.step_time_factor * (unloaded_s or 0.0))
    duration = min(spec.max_step_s, wanted)
    drain = max(spec.drain_s(), DRAIN_REQUEST_TIMES * (unloaded_s or 0.0))
    short: str | None = None
    if wanted > spec.max_step_s:
        short = (
            f"a steady state needs {wanted:.3g} s ({spec.step_time_factor:g} unloaded request "
            f"times of {unloaded_s or 0:.3g} s), over max_step_s ({spec.max_step_s:g} s)"
        )
    if spec.variable == "concurrency":
        cap = available if available is not None else MAX_LIST_REQUESTS
        if unloaded_s:  # long enough for ``floor`` requests even if nobody waited
            duration = min(spec.max_step_s, max(duration, floor * unloaded_s / max(1.0, load)))
        return StepPlan(
            load=load,
            variable="concurrency",
            requests=cap,
            span_s=duration,
            warmup_requests=0,
            warmup_s=spec.warmup_fraction * duration,
            drain_s=drain,
            in_flight=max(1, round(load)),
            unloaded_s=unloaded_s,
            short=short,
        )
    n = max(floor, math.ceil(load * duration) + 1, 2)
    if available is not None and n > available:
        short = short or (
            f"the request list holds {available} requests: {available / load:.3g} s at "
            f"{load:.3g} req/s, under the step's {n / load:.3g} s"
        )
        n = available
    if (n - 1) / load > spec.max_step_s * 1.000001 and short is None:
        short = (
            f"{n} requests at {load:.3g} req/s last {(n - 1) / load:.3g} s, over "
            f"max_step_s ({spec.max_step_s:g} s)"
        )
        n = max(2, math.floor(spec.max_step_s * load) + 1)
    warm = min(n - 2, max(1, math.ceil(spec.warmup_fraction * n)))
    return StepPlan(
        load=load,
        variable="request_rate",
        requests=n,
        span_s=(n - 1) / load,
        warmup_requests=warm,
        warmup_s=warm / load,
        drain_s=drain,
        in_flight=in_flight,
        unloaded_s=unloaded_s,
        short=short,
    )


def scale_schedule(offsets: Sequence[float], plan: StepPlan) -> list[float]:
    """The step's arrival offsets: ``offsets`` (the workload's pattern at the step's rate,
    first at 0) scaled piecewise so that the warm-up part (requests ``0 .. w - 1``) ends at
    ``w / L`` and the measured part (``w .. n - 1``) spans exactly ``(n - w - 1) / L``: each
    offers rate ``L`` exactly. Constant arrivals come out unchanged."""
    n, w, rate = len(offsets), plan.warmup_requests, plan.load
    if n < 2 or not 0 < w < n - 1:
        return list(offsets)
    out = [0.0] * n
    head = offsets[w] - offsets[0]
    for i in range(w):
        out[i] = (offsets[i] - offsets[0]) * (w / rate) / head if head > 0 else i / rate
    tail = offsets[n - 1] - offsets[w]
    for i in range(w, n):
        scaled = (offsets[i] - offsets[w]) * ((n - 1 - w) / rate) / tail if tail > 0 else 0.0
        out[i] = w / rate + (scaled if tail > 0 else (i - w) / rate)
    return out
