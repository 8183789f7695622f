"""Capacity under SLOs: the highest load one server sustains, in steady state, while every
objective holds.

The search drives load steps on one running server (the runner owns the server and
the load; this module only decides). For each step the runner asks for the step's
plan (:meth:`CapacitySearch.plan`: how many requests, how long, which part is warm-up;
:mod:`jobs.capacity.steadystate`), replays the first requests of the same request list (same
order, prefix cache reset before the step) at that load, and hands the step's records
and server signals to :meth:`CapacitySearch.record`. The search:

- decides each step **pass / fail / uncertain / client_limited** from its measured part
  (the warm-up part excluded): every objective's percentile and its distribution-free
  interval (:mod:`jobs.capacity.slochecks`: it passes when the interval's upper end is at or
  under the objective, fails when the lower end is over it), whether the queue was
  **stationary** (:mod:`jobs.capacity.steadystate`), whether the load that was asked for arrived
  (the load generator's limits) and the server's own evidence of saturation;
- narrows to the boundary: ``min`` first (a failure there: capacity below ``min``),
  then ``max`` (a pass there: capacity at least ``max``), then bisects between the
  highest passing load and the lowest failing (or client-limited) one (geometric
  midpoint for request rates, integer midpoint for concurrency) until the bracket's
  relative width is within ``tolerance`` or ``max_steps`` is spent;
- never goes above what the load generator can deliver: above a known
  ``client_ceiling`` (req/s, calibrated against the stub on the same node) it measures
  nothing, and after a ``client_limited`` step it only searches below that load.

The result (:class:`CapacityResult`) is the highest passing load with the bracket
``[highest pass, lowest fail]`` as its interval, the SLO that binds first (the one
that failed at the lowest load), the load generator's ceiling when known, and every step.

The step's verdict (:mod:`jobs.capacity.verdict`, whose docstring has the rules): a step
passes only when every objective holds at its confidence and the queue was stationary
over the measured part; it fails on an objective or on server evidence of saturation
(failed requests, the server's waiting queue or the requests due and not done growing);
it is ``client_limited`` when the load generator could not deliver the load asked for
(never blamed on the server); anything it cannot tell is ``uncertain``.

- **Re-measurement**: an ``uncertain`` step is measured again at the same load (up to
  ``remeasure`` times); each re-measurement is a step of its own whose checks pool the
  records of every measurement at that load, and whose steadiness pools their queue
  growth (``measurements`` says how many), so the evidence accumulates instead of the
  search picking the luckiest of several tries.
- **Search**: loads for ``concurrency`` are integers (``ceil(min)``, ``floor(max)``,
  integer midpoints; done when ``hi - lo <= 1``); for ``request_rate`` the midpoint
  is geometric and it is done when ``(hi - lo) / lo <= tolerance``. ``hi`` is the
  lowest failing load, or the lowest client-limited one when that is lower.
- **Status**: ``found`` (``capacity`` = highest passing load, interval ``(lo, hi)``);
  ``below_min`` (``min`` failed; interval ``(None, min)``); ``at_least_max``
  (``max`` passed; interval ``(max, None)``); ``client_limited`` (the search reached
  loads the load generator could not deliver before any failed; interval
  ``(highest pass or None, None)``: "at least X", with ``client_ceiling`` and the way
  out in ``note``); ``uncertain`` (a step stayed uncertain; interval = the bracket so
  far); ``steps_exhausted`` (``max_steps`` spent before the bracket narrowed to the
  tolerance; interval = the bracket). Only ``found`` has a ``capacity``: anything else
  is unknown, never a guess.
- **client_ceiling**: the lowest arrived rate of a client-limited step (observed here),
  else the calibrated ceiling given to the search; None when unknown.
- **binding_slo**: at the lowest failing load, the failing objective with the
  largest excess over its objective (value / objective; goodput: objective / value),
  named ``"<metric>:<percentile>"`` (``"ttft_ms:p99"``) or ``"goodput"``; a step
  that failed only on saturation names ``"saturated"``.

Pure: no I/O, no clock, no randomness.

Size: the search and its contract (:class:`CapacitySpec`, :class:`CapacityResult`) are one
module because the node contract (:mod:`jobs.schemas`) may import this one module of
``jobs.capacity`` (the layer table's exception); the step's own analysis and verdict are
already apart (:mod:`jobs.capacity.steadystate`, :mod:`jobs.capacity.verdict`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)

from jobs.capacity.slochecks import (
    SLOCheck,
    SLOMetric,
    StepValues,
    excess,
    interval_end,
    min_requests_to_pass,
    percentile_interval,
    percentile_of,
    proportion_interval,
    slo_name,
    step_values,
)
from jobs.capacity.steadystate import (
    MIN_CLOSED_LOOP_REQUESTS,
    MIN_MEASURED_ARRIVALS,
    Growth,
    StepDynamics,
    analyze,
    in_flight_cap_limit,
)
from jobs.capacity.stepplan import StepPlan, min_measured, plan_step, unloaded_time
from jobs.capacity.verdict import CapacityStep, StepSignals, decide

if TYPE_CHECKING:  # jobs.schemas imports this module
    from jobs.schemas import RequestRecord

__all__ = [
    "CapacityResult",
    "CapacitySearch",
    "CapacitySpec",
    "CapacityStep",
    "SLOCheck",
    "StepPlan",
    "StepSignals",
    "StepValues",
    "min_requests_to_pass",
    "percentile_interval",
    "percentile_of",
    "proportion_interval",
    "run_search",
    "step_values",
]

CapacityVariable = Literal["request_rate", "concurrency"]
Verdict = Literal["pass", "fail", "uncertain", "client_limited"]
SearchStatus = Literal[
    "found", "below_min", "at_least_max", "uncertain", "steps_exhausted", "client_limited"
]

DEFAULT_DRAIN_S = 30.0
"""A step's drain limit when ``max_drain_s`` is not set (and no objective is longer)."""

WAY_OUT = (
    "to measure beyond it, run more load-generator worker processes, put the load "
    "generator on another node, or lower max"
)


class CapacitySpec(BaseModel):
    """What to search: objectives, the load variable and its range, how long steps last.

    ``slos``: per metric (``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2el_ms``) a map of
    percentile name (``p50``, ``p90``, ``p99``, ``p99.9``) to the objective in ms, e.g.
    ``{"ttft_ms": {"p99": 500}, "tpot_ms": {"p99": 50}}``. ``goodput``: optionally the
    least fraction of a step's requests that meet every per-request objective (the
    objectives' values, as ``vllm bench serve --goodput`` counts them).

    Steady state (:mod:`jobs.capacity.steadystate`): a step lasts ``max(min_step_s,
    step_time_factor * unloaded request time)`` seconds, at most ``max_step_s``, and
    sends at least ``requests_per_step`` requests (a floor, not the length); its first
    ``warmup_fraction`` is warm-up, excluded from the decision; requests unfinished
    :meth:`drain_s` after its last arrival are cut (counted failed).

    Raises (validation):
        ValueError: no objective at all, a percentile name that is not ``p<number>``,
            a non-positive objective, ``min > max``, (concurrency) no integer in
            ``[min, max]``, ``max_step_s < min_step_s``, or ``max_drain_s`` under the
            largest TTFT/E2EL objective (a cut request must be over every objective).
    """

    model_config = ConfigDict(extra="forbid")

    slos: dict[SLOMetric, dict[str, StrictFloat]] = Field(default_factory=dict)
    goodput: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    variable: CapacityVariable = "request_rate"
    min: StrictFloat = Field(gt=0.0)
    max: StrictFloat = Field(gt=0.0)
    tolerance: StrictFloat = Field(0.05, gt=0.0, le=1.0, description="relative bracket width")
    max_steps: StrictInt = Field(12, ge=2, le=64)
    requests_per_step: int | None = Field(
        None, ge=10, le=100_000, description="the fewest requests a step sends (a floor)"
    )
    confidence: float = Field(0.95, gt=0.5, lt=1.0)
    remeasure: int = Field(1, ge=0, le=3, description="extra measurements of an uncertain step")
    load_workers: StrictInt = Field(
        1,
        ge=1,
        le=32,
        description="load-generator processes sharing each step's schedule (jobs.load.loadpool)",
    )
    calibrate_client: StrictBool = Field(
        True,
        description="request_rate: measure the load generator's ceiling against a stub on the "
        "run's node before the search (jobs.load.loadceiling); steps above it are client_limited",
    )
    min_step_s: StrictFloat = Field(
        10.0, ge=0.5, le=3600.0, description="the shortest step, seconds of arrivals"
    )
    step_time_factor: StrictFloat = Field(
        20.0, ge=1.0, le=1000.0, description="a step lasts at least this many unloaded requests"
    )
    max_step_s: StrictFloat = Field(300.0, ge=0.5, le=3600.0, description="the longest step")
    warmup_fraction: StrictFloat = Field(
        0.2, ge=0.05, le=0.5, description="the first part of a step, excluded as warm-up"
    )
    max_drain_s: StrictFloat | None = Field(
        None,
        gt=0.0,
        le=3600.0,
        description="seconds after a step's last arrival before a cut (default: 30, or the "
        "largest TTFT/E2EL objective if longer)",
    )

    @model_validator(mode="after")
    def _check(self) -> CapacitySpec:
        if not any(self.slos.values()) and self.goodput is None:
            raise ValueError("capacity needs at least one objective (slos or goodput)")
        if self.goodput is not None and not any(
            self.slos.get(m) for m in ("ttft_ms", "tpot_ms", "e2el_ms")
        ):
            raise ValueError(
                "goodput counts the requests that meet the TTFT, TPOT and E2EL objectives: "
                "set at least one of them in slos"
            )
        for metric, objectives in self.slos.items():
            for name, objective in objectives.items():
                percentile_of(name)
                if not (math.isfinite(objective) and objective > 0):
                    raise ValueError(f"objective {metric} {name} must be > 0 ms, got {objective}")
        if self.min > self.max:
            raise ValueError(f"capacity min {self.min} is over max {self.max}")
        if self.variable == "concurrency" and math.ceil(self.min) > math.floor(self.max):
            raise ValueError(f"no integer concurrency within [{self.min}, {self.max}]")
        if self.max_step_s < self.min_step_s:
            raise ValueError(
                f"max_step_s ({self.max_step_s:g} s) is under min_step_s ({self.min_step_s:g} s):"
                " no step could last long enough to reach a steady state"
            )
        latency_s = self._latency_objective_s()
        if self.max_drain_s is not None and self.max_drain_s < latency_s:
            raise ValueError(
                f"max_drain_s ({self.max_drain_s:g} s) is under the largest TTFT/E2EL objective "
                f"({latency_s:g} s): a request cut after it must be over every objective"
            )
        return self

    def _latency_objective_s(self) -> float:
        objectives = [
            o for m, objs in self.slos.items() if m in ("ttft_ms", "e2el_ms") for o in objs.values()
        ]
        return max(objectives, default=0.0) / 1000.0

    @property
    def calibrates(self) -> bool:
        """Each run measures its load generator's ceiling before the search
        (``calibrate_client``, request-rate searches only)."""
        return self.variable == "request_rate" and self.calibrate_client

    def drain_s(self) -> float:
        """Seconds a step's requests may take after its last arrival before the step is
        cut: ``max_drain_s``, by default :data:`DEFAULT_DRAIN_S` or the largest TTFT/E2EL
        objective if longer (a cut request is then over every objective)."""
        if self.max_drain_s is not None:
            return self.max_drain_s
        return max(DEFAULT_DRAIN_S, self._latency_objective_s())

    def needed_measured(self) -> int:
        """Measured requests a step needs to ever pass: the objectives' percentiles
        (:func:`~jobs.capacity.slochecks.min_requests_to_pass`) and the steadiness test."""
        closed = self.variable == "concurrency"
        need = MIN_CLOSED_LOOP_REQUESTS if closed else MIN_MEASURED_ARRIVALS
        for objectives in self.slos.values():
            for name in objectives:
                need = max(need, min_requests_to_pass(percentile_of(name), self.confidence))
        return need


class CapacityResult(BaseModel):
    """The boundary: ``capacity`` (highest passing load) and its bracket."""

    variable: CapacityVariable
    status: SearchStatus
    capacity: float | None = None
    interval: tuple[float | None, float | None] = (None, None)
    binding_slo: str | None = None
    client_ceiling: float | None = Field(
        None, description="req/s the load generator sustains here (observed or calibrated)"
    )
    steps: list[CapacityStep] = Field(default_factory=list)
    note: str | None = None


class CapacitySearch:
    """The capacity search, one step at a time (see the module docstring for the rules).

    Drive it with ``while (load := search.next_load()) is not None: plan =
    search.plan(load); ...; search.record(load, records, signals, duration_s, plan=plan)``,
    then :meth:`result`; or use :func:`run_search`. Deterministic given the records.

    Args:
        spec: what to search.
        client_ceiling: req/s the load generator sustains for this workload where it runs
            (calibrated); the search measures nothing above it. None: unknown.
        unloaded_s: one request's time on an idle server (the warm-ups'); None: the
            first step gives it.
        available: requests in the run's request list (None: unlimited).
        floor: the fewest requests a step sends (default ``requests_per_step``), raised
            to what the objectives and the steadiness test need.
        in_flight: the open loop's in-flight cap (the workload's ``concurrency``).
    """

    def __init__(
        self,
        spec: CapacitySpec,
        *,
        client_ceiling: float | None = None,
        unloaded_s: float | None = None,
        available: int | None = None,
        floor: int | None = None,
        in_flight: int | None = None,
    ) -> None:
        self.spec = spec
        self.client_ceiling = client_ceiling
        self.unloaded_s = unloaded_s
        self._available = available
        self._floor = max(
            floor or spec.requests_per_step or 0, min_measured(spec, spec.needed_measured())
        )
        self._in_flight = in_flight or 1_000_000
        self._steps: list[CapacityStep] = []
        self._lo: float | None = None  # highest passing load
        self._hi: float | None = None  # lowest failing load
        self._cl: float | None = None  # lowest client-limited load
        self._observed: float | None = None  # lowest arrived rate of a client-limited step
        self._binding: str | None = None  # at the lowest failing load
        self._pending: float | None = None  # a load to measure again
        self._pooled: dict[float, tuple[int, StepValues, list[Growth]]] = {}
        self._status: SearchStatus | None = None
        self._note: str | None = None
        self._tried_max = False
        if spec.variable == "concurrency":
            self._min, self._max = float(math.ceil(spec.min)), float(math.floor(spec.max))
        else:
            self._min, self._max = spec.min, spec.max
            if client_ceiling is not None and client_ceiling < self._max:
                self._max = max(self._min, client_ceiling)  # nothing above the ceiling
                if client_ceiling < self._min:
                    self._finish(
                        "client_limited",
                        f"the load generator's ceiling here ({client_ceiling:.4g} req/s, "
                        f"calibrated) is under min ({self._min:g}); {WAY_OUT}",
                    )

    # -- driving ------------------------------------------------------------------------

    def next_load(self) -> float | None:
        """The next load to measure (requests/s, or an integer concurrency); None: done."""
        if self._status is not None:
            return None
        upper = self._upper()
        lo = self._lo
        ready = self._pending is None and self._tried_max
        if ready and lo is not None and upper is not None and self._converged(lo, upper):
            self._finish_bracket()  # narrowed enough, even on the last allowed step
            return None
        if len(self._steps) >= self.spec.max_steps:
            self._finish("steps_exhausted", f"max_steps ({self.spec.max_steps}) spent")
            return None
        if self._pending is not None:
            return self._pending
        if not self._steps:
            return self._min
        if not self._tried_max:
            if self._max == self._min:  # one load only: the min step decided it all
                self._finish_top(self._min)
                return None
            return self._max
        assert lo is not None and upper is not None  # min passed, max did not
        if self.spec.variable == "concurrency":
            return float((int(lo) + int(upper)) // 2)
        return math.sqrt(lo * upper)

    def plan(self, load: float) -> StepPlan:
        """How the step at ``load`` is driven (:func:`jobs.capacity.stepplan.plan_step`)."""
        return plan_step(
            self.spec,
            load,
            unloaded_s=self.unloaded_s,
            available=self._available,
            floor=self._floor,
            in_flight=self._in_flight,
        )

    def record(
        self,
        load: float,
        records: Sequence[RequestRecord],
        signals: StepSignals,
        duration_s: float | None = None,
        *,
        plan: StepPlan | None = None,
        cut: bool = False,
        stalls: Sequence[tuple[float, float]] | None = None,
    ) -> CapacityStep:
        """Decide one measured step at ``load`` and move the search on.

        Args:
            load: the load measured (the value :meth:`next_load` gave).
            records: every record of the step, its warm-up part included (records
                marked ``warmup`` before the step are ignored).
            signals: the server's and client's signals during the step (``client_cpu``
                and ``client_workers`` from the runner; the rest is derived here).
            duration_s: the step's wall time (for the throughputs).
            plan: how the step was driven (default :meth:`plan` of ``load``).
            cut: the step was cut ``drain_s`` after its last arrival; its planned
                requests without a record count as failed.
            stalls: the load generator's stalls during the step (:class:`jobs.load.stalls.
                LoopWatch`; None: not watched): enough of them make it ``client_limited``.

        Returns:
            The step as stored (also in :meth:`result`'s ``steps``).

        Raises:
            RuntimeError: the search is over.
        """
        if self._status is not None:
            raise RuntimeError("the capacity search is over")
        plan = plan or self.plan(load)
        dyn = analyze(
            records,
            plan,
            client_cpu=signals.client_cpu,
            client_workers=signals.client_workers,
            client_ceiling=self.client_ceiling,
            stalls=stalls,
        )
        if not self._steps:  # the first step's first request found the server idle
            self.unloaded_s = unloaded_time(records, "min") or self.unloaded_s
        own = step_values(dyn.measured)
        cap_limit = in_flight_cap_limit(dyn, plan, self.unloaded_s)
        if cap_limit and not dyn.client_limits:
            dyn.client_limits.append(cap_limit)
        if cut:
            cut = _count_cut(dyn, plan, own, records)
        count, pooled, growth = self._pooled.get(load, (0, StepValues(), []))
        pooled.extend(own)
        if dyn.growth is not None and dyn.too_short is None:
            growth.append(dyn.growth)
        count += 1
        self._pooled[load] = (count, pooled, growth)
        signals = _step_signals(signals, dyn, own)
        step = decide(
            self.spec,
            len(self._steps),
            load,
            plan,
            dyn,
            own,
            pooled,
            count,
            growth,
            signals,
            duration_s,
            cut,
        )
        self._steps.append(step)
        self._advance(load, step, count)
        return step

    def result(self) -> CapacityResult:
        """The outcome so far (final once :meth:`next_load` answered None)."""
        status = self._status
        if status is None:
            status = "steps_exhausted" if len(self._steps) >= self.spec.max_steps else "uncertain"
        capacity = self._lo if status == "found" else None
        if status == "below_min":
            interval: tuple[float | None, float | None] = (None, self._min)
        elif status == "at_least_max":
            interval = (self._max, None)
        elif status == "client_limited":
            interval = (self._lo, None)
        else:
            interval = (self._lo, self._hi)
        note = self._note if self._status is not None else "the search has not finished"
        return CapacityResult(
            variable=self.spec.variable,
            status=status,
            capacity=capacity,
            interval=interval,
            binding_slo=self._binding,
            client_ceiling=self._ceiling(),
            steps=list(self._steps),
            note=note,
        )

    # -- deciding -----------------------------------------------------------------------
    def _advance(self, load: float, step: CapacityStep, count: int) -> None:
        if step.verdict == "uncertain":
            if count <= self.spec.remeasure:
                self._pending = load
                return
            why = [
                f"{slo_name(c)} interval [{interval_end(c.ci_low)}, {interval_end(c.ci_high)}] "
                f"straddles {c.objective:g}"
                for c in step.checks
                if c.verdict == "uncertain"
            ]
            if step.stationary is not True and step.stationarity:
                why.append(f"steadiness {step.stationarity}")
            what = "; ".join(why) or "nothing measured"
            self._finish("uncertain", f"at load {load:g} after {count} measurement(s): {what}")
            return
        self._pending = None
        if step.verdict == "client_limited":
            self._cl = load if self._cl is None else min(self._cl, load)
            arrived = step.signals.arrived_rate
            seen = arrived if arrived is not None and arrived > 0 else None
            if seen is not None:
                self._observed = seen if self._observed is None else min(self._observed, seen)
            if load == self._max:
                self._tried_max = True
            if self._lo is None:
                self._finish("client_limited", None)
            return
        if step.verdict == "pass":
            self._lo = load if self._lo is None else max(self._lo, load)
        elif self._hi is None or load < self._hi:
            self._hi = load
            self._binding = self._binding_of(step)
        if load == self._min and not self._tried_max:
            if step.verdict == "fail":
                self._finish("below_min", f"the objectives fail at min load {load:g}")
            return
        if load == self._max:
            self._tried_max = True
            if step.verdict == "pass":
                self._finish_top(load)

    def _upper(self) -> float | None:
        """The bracket's upper end: the lowest failing or client-limited load."""
        ends = [x for x in (self._hi, self._cl) if x is not None]
        return min(ends) if ends else None

    def _converged(self, lo: float, hi: float) -> bool:
        if self.spec.variable == "concurrency":
            return hi - lo <= 1
        return (hi - lo) / lo <= self.spec.tolerance

    def _finish_top(self, load: float) -> None:
        """The highest load the search may try passed: ``max``, or the ceiling under it."""
        if self._max < self.spec.max and self.spec.variable == "request_rate":
            self._finish("client_limited", None)
        else:
            self._finish("at_least_max", f"every objective holds at max load {load:g}")

    def _finish_bracket(self) -> None:
        """The bracket narrowed to the tolerance: found, unless its top is client-limited."""
        if self._hi is not None and (self._cl is None or self._hi <= self._cl):
            self._finish("found", None)
        else:
            self._finish("client_limited", None)

    def _ceiling(self) -> float | None:
        return self._observed if self._observed is not None else self.client_ceiling

    def _client_note(self) -> str:
        unit = "req/s" if self.spec.variable == "request_rate" else "in flight"
        ceiling = self._ceiling()
        if self._observed is not None:
            step = next(s for s in self._steps if s.verdict == "client_limited")
            source = (
                f"observed: at {step.load:g} {unit} the load generator sent "
                f"{step.signals.arrived_rate or 0:.4g} req/s ({step.client_limit})"
            )
        else:
            source = "calibrated against the stub server on this node"
        head = f"at least {self._lo:g} {unit}" if self._lo is not None else "no step passed"
        where = f"{ceiling:.4g} req/s" if ceiling is not None else "unknown"
        return f"{head}; the load generator's ceiling here is {where} ({source}); {WAY_OUT}"

    def _binding_of(self, step: CapacityStep) -> str:
        failed = [c for c in step.checks if c.verdict == "fail"]
        if not failed:
            return "saturated"
        return slo_name(max(failed, key=excess))

    def _finish(self, status: SearchStatus, note: str | None) -> None:
        self._status = status
        if status == "client_limited" and note is None:
            note = self._client_note()
        if note is not None:
            self._note = note
        elif status == "found":
            self._note = None
        self._pending = None


def _count_cut(
    dyn: StepDynamics, plan: StepPlan, own: StepValues, records: Sequence[RequestRecord]
) -> bool:
    """A step cut ``drain_s`` after its last due arrival: with a client limit, the requests
    not done may never have been sent (noted as a client limit; the cut no longer
    counts: False); at a request rate they were sent and did not finish (counted failed
    in ``own``; True)."""
    if dyn.client_limits:
        dyn.client_limits.append(
            f"the step was cut {plan.drain_s:.3g} s after its last due arrival, with "
            "requests not sent or not finished"
        )
        return False
    if plan.variable == "request_rate":
        unfinished = max(0, plan.requests - sum(1 for r in records if not r.warmup))
        own.requests += unfinished
        own.failed += unfinished
        own.per_request.extend([None] * unfinished)
    return True


def _step_signals(signals: StepSignals, dyn: StepDynamics, own: StepValues) -> StepSignals:
    """The step's signals with what :func:`analyze` derived (the dispatch lag from the
    records when the runner gave none)."""
    return signals.model_copy(
        update={
            "asked_rate": dyn.asked_rate,
            "arrived_rate": dyn.arrived_rate,
            "completed_rate": dyn.completed_rate,
            "client_lag_p90_ms": dyn.client_lag_p90_ms,
            "slot_wait_p90_ms": dyn.slot_wait_p90_ms,
            "queue_growth": dyn.growth.growth if dyn.growth else None,
            "dispatch_lag_p99_ms": signals.dispatch_lag_p99_ms
            if signals.dispatch_lag_p99_ms is not None
            else (float(np.percentile(own.dispatch_lag_ms, 99)) if own.dispatch_lag_ms else None),
        }
    )


def run_search(
    spec: CapacitySpec,
    step: Callable[[StepPlan], tuple[Sequence[RequestRecord], StepSignals, float | None]],
    *,
    client_ceiling: float | None = None,
    unloaded_s: float | None = None,
    in_flight: int | None = None,
) -> CapacityResult:
    """Run a whole capacity search: ``step(plan)`` measures one step.

    Args:
        spec: what to search.
        step: measures one step as planned (``plan.load``: requests/s, or an integer
            concurrency as a float; ``plan.requests``, ``plan.span_s``...) and returns
            ``(records, signals, duration_s)``: all the step's records, its signals, and
            its wall time in seconds (or None).
        client_ceiling, unloaded_s, in_flight: as :class:`CapacitySearch`.

    Returns:
        The :class:`CapacityResult` (``len(result.steps)`` steps were measured).
    """
    search = CapacitySearch(
        spec, client_ceiling=client_ceiling, unloaded_s=unloaded_s, in_flight=in_flight
    )
    while (load := search.next_load()) is not None:
        plan = search.plan(load)
        records, signals, duration_s = step(plan)
        search.record(load, records, signals, duration_s, plan=plan)
    return search.result()
