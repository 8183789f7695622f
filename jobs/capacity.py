"""Capacity under SLOs: the highest load one server sustains while every objective holds.

The search drives load steps on one running server (the runner owns the server and
the load; this module only decides). For each step the runner replays the same
request list (same order, prefix cache reset before the step's measured requests)
at one load level, and hands the step's measured records and server signals to
:meth:`CapacitySearch.record`. The search:

- decides each step **pass / fail / uncertain** from the step's own percentile and
  its distribution-free interval: an objective passes when the interval's upper end is at or
  under it, fails when the lower end is over it; a straddling interval is measured
  again (once, by default) and stays ``uncertain`` if it still straddles: the
  search then stops and reports ``uncertain`` rather than guess;
- narrows to the boundary: ``min`` first (a failure there: capacity below ``min``),
  then ``max`` (a pass there: capacity at least ``max``), then bisects between the
  highest passing and the lowest failing load (geometric midpoint for request
  rates, integer midpoint for concurrency) until the bracket's relative width is
  within ``tolerance`` or ``max_steps`` is spent;
- stops early when the server is saturated (waiting requests growing through the
  step, client dispatch lag, failed requests): that step fails as ``saturated``
  and nothing above it is tried.

The result (:class:`CapacityResult`) is the highest passing load with the bracket
``[highest pass, lowest fail]`` as its interval, the SLO that binds first (the one
that failed at the lowest load), and every step.

Decision details (the rules :class:`CapacitySearch` applies):

- **Per-request values** (:func:`step_values`): TTFT, TPOT, ITL and E2EL in ms as
  ``vllm bench serve`` defines them (``jobs.loadgen``): percentiles over the
  successful requests (ITL pools every gap of every successful request; TPOT covers
  requests with more than one output token). Failed requests count in the step's
  ``failed``, in the saturation rule and in goodput (a failed request is never good).
- **Percentile interval**: ``numpy.percentile`` (linear) of the step's values, and a
  distribution-free interval from order statistics (:func:`percentile_interval`: the
  count of values under the true percentile is binomial), ``ci_low`` / ``ci_high`` at
  ``confidence``. Where no order statistic reaches that confidence the end is
  ``None``: a p99 objective over fewer than 368 requests (95 %, two-sided) has no upper end, so
  such a step can fail but never pass (a bootstrap would pass it whenever the few
  values happen to sit under the objective). An objective whose metric has no value
  at a step with successful requests (TPOT when every request has one output token)
  passes, as vLLM's goodput counts such a TPOT as 0; with no successful request at
  all it fails. Latencies that are missing, negative or not finite make the request
  failed (never a number). A step with no measured request is ``uncertain``.
- **Goodput**: the fraction of the step's requests (failed ones included) whose
  TTFT, TPOT and E2EL are each at or under that metric's strictest objective (ITL
  is not a per-request value; vLLM's ``--goodput`` ignores it too); the Wilson score
  interval of that fraction (:func:`proportion_interval`); passes when ``ci_low >= goodput``,
  fails when ``ci_high < goodput``.
- **Re-measurement**: a step that is ``uncertain`` is measured again at the same load
  (up to ``remeasure`` times); each re-measurement is a step of its own whose checks
  pool the records of every measurement at that load (``measurements`` says how
  many), so the interval narrows instead of the search picking the luckiest of
  several independent tries.
- **Saturation** (the step fails with ``saturated`` set, whatever its checks say):
  failed requests over :data:`SATURATION_FAILED_FRACTION` (5 %) of the step; for
  ``request_rate`` only, the server's waiting queue grew through the step
  (``waiting_last - waiting_first`` over ``max(1, 5 % of the step's requests)`` and
  ``waiting_max > 0``: below capacity the queue at two instants differs by O(1)
  requests, above it it grows by ``(1 - mu/lambda) * N`` over ``N`` arrivals, so
  5 % of ``N`` flags an arrival rate ~5 % over the service rate; in a closed loop
  the queue is bounded by the concurrency, so it is no sign of overload there); for
  ``request_rate`` only, the client's dispatch lag (``start_s - scheduled_s``)
  p99 over ``max(50 ms, two mean inter-arrival gaps)``: the client could not offer
  the nominal rate.
- **Search**: loads for ``concurrency`` are integers (``ceil(min)``, ``floor(max)``,
  integer midpoints; done when ``hi - lo <= 1``); for ``request_rate`` the midpoint
  is geometric and it is done when ``(hi - lo) / lo <= tolerance``.
- **Status**: ``found`` (``capacity`` = highest passing load, interval ``(lo, hi)``);
  ``below_min`` (``min`` failed; interval ``(None, min)``); ``at_least_max``
  (``max`` passed; interval ``(max, None)``); ``uncertain`` (a step stayed
  uncertain; interval = the bracket so far); ``steps_exhausted`` (``max_steps``
  spent before the bracket narrowed to the tolerance; interval = the bracket).
  Only ``found`` has a ``capacity``: anything else is unknown, never a guess.
- **binding_slo**: at the lowest failing load, the failing objective with the
  largest excess over its objective (value / objective; goodput: objective / value),
  named ``"<metric>:<percentile>"`` (``"ttft_ms:p99"``) or ``"goodput"``; a step
  that failed only on saturation names ``"saturated"``.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, model_validator

if TYPE_CHECKING:  # jobs.schemas imports this module
    from jobs.schemas import RequestRecord

__all__ = [
    "CapacityResult",
    "CapacitySearch",
    "CapacitySpec",
    "CapacityStep",
    "SLOCheck",
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
SLOMetric = Literal["ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"]
Verdict = Literal["pass", "fail", "uncertain"]
SearchStatus = Literal["found", "below_min", "at_least_max", "uncertain", "steps_exhausted"]

SATURATION_FAILED_FRACTION = 0.05
"""A step with more failed requests than this fraction is saturated."""

SATURATION_WAITING_FRACTION = 0.05
"""Waiting-queue growth through a step, as a fraction of its requests, that means overload."""

DISPATCH_LAG_FLOOR_MS = 50.0
"""Dispatch lag p99 under this is never saturation (client timer jitter)."""

REPORTED_PERCENTILES = ("p50", "p90", "p99")
"""Percentiles every step reports per metric (besides those the objectives name)."""

_PERCENTILE_NAME = re.compile(r"^p(\d+(?:\.\d+)?)$")
_METRICS: tuple[SLOMetric, ...] = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


def percentile_of(name: str) -> float:
    """The percentile a name means: ``"p99"`` -> 99.0, ``"p99.9"`` -> 99.9.

    Raises:
        ValueError: not ``p<number>`` with the number in (0, 100) (p100 is the maximum:
            no interval can bound it).
    """
    match = _PERCENTILE_NAME.match(name)
    value = float(match.group(1)) if match else -1.0
    if not 0.0 < value < 100.0:
        raise ValueError(f"percentile name must be like p50, p99 or p99.9, got {name!r}")
    return value


class CapacitySpec(BaseModel):
    """What to search: objectives, the load variable and its range.

    ``slos``: per metric (``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2el_ms``) a map of
    percentile name (``p50``, ``p90``, ``p99``, ``p99.9``) to the objective in ms, e.g.
    ``{"ttft_ms": {"p99": 500}, "tpot_ms": {"p99": 50}}``. ``goodput``: optionally the
    least fraction of a step's requests that meet every per-request objective (the
    objectives' values, as ``vllm bench serve --goodput`` counts them).

    Raises (validation):
        ValueError: no objective at all, a percentile name that is not ``p<number>``,
            a non-positive objective, ``min > max``, or (concurrency) no integer in
            ``[min, max]``.
    """

    model_config = ConfigDict(extra="forbid")

    slos: dict[SLOMetric, dict[str, StrictFloat]] = Field(default_factory=dict)
    goodput: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    variable: CapacityVariable = "request_rate"
    min: StrictFloat = Field(gt=0.0)
    max: StrictFloat = Field(gt=0.0)
    tolerance: StrictFloat = Field(0.05, gt=0.0, le=1.0, description="relative bracket width")
    max_steps: StrictInt = Field(12, ge=2, le=64)
    requests_per_step: int | None = Field(None, ge=10, le=100_000)
    confidence: float = Field(0.95, gt=0.5, lt=1.0)
    remeasure: int = Field(1, ge=0, le=3, description="extra measurements of a straddling step")

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
        return self


class StepSignals(BaseModel):
    """Server and client signals of one step (``None``: not observed).

    ``waiting_first`` / ``waiting_last``: ``vllm:num_requests_waiting`` when the step's
    first request was sent and when its last one was sent (end of dispatch);
    ``waiting_max`` the most seen in between. ``dispatch_lag_p99_ms``: open loop, the
    p99 of ``start_s - scheduled_s`` (computed from the records when not given).
    """

    waiting_first: float | None = None
    waiting_last: float | None = None
    waiting_max: float | None = None
    kv_cache_usage_max: float | None = None
    dispatch_lag_p99_ms: float | None = None


class SLOCheck(BaseModel):
    """One objective at one step: the percentile, its interval and the verdict."""

    metric: SLOMetric | Literal["goodput"]
    percentile: str | None = None
    objective: float
    value: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    verdict: Verdict


class CapacityStep(BaseModel):
    """One load step as measured (re-measurements are steps of their own)."""

    index: int
    load: float
    requests: int
    failed: int
    duration_s: float | None = None
    percentiles: dict[str, dict[str, float]] = Field(default_factory=dict)
    goodput: float | None = None
    output_tokens_per_s: float | None = Field(None, description="the step's output tokens / s")
    output_tokens_per_s_per_user: float | None = Field(
        None, description="mean over requests of output tokens / (E2EL - TTFT): tokens/s/user"
    )
    signals: StepSignals = Field(default_factory=StepSignals)
    checks: list[SLOCheck] = Field(default_factory=list)
    saturated: str | None = None
    verdict: Verdict
    measurements: int = Field(
        1, description="measurements at this load whose records the checks pooled"
    )


class CapacityResult(BaseModel):
    """The boundary: ``capacity`` (highest passing load) and its bracket."""

    variable: CapacityVariable
    status: SearchStatus
    capacity: float | None = None
    interval: tuple[float | None, float | None] = (None, None)
    binding_slo: str | None = None
    steps: list[CapacityStep] = Field(default_factory=list)
    note: str | None = None


@dataclass
class StepValues:
    """Per-request values of one step's measured requests (ms; warm-ups excluded).

    ``ttft_ms``, ``tpot_ms``, ``e2el_ms``: one per successful request that has it;
    ``itl_ms``: every gap of every successful request; ``per_request``: for each
    measured request (failed ones too) its ``(ttft, tpot, e2el)`` in ms (``None``
    for a failed request; TPOT ``0`` with at most one output token, as vLLM's
    goodput); ``dispatch_lag_ms``: ``start_s - scheduled_s`` of open-loop requests.
    """

    requests: int = 0
    failed: int = 0
    output_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    e2el_ms: list[float] = field(default_factory=list)
    per_request: list[tuple[float, float, float] | None] = field(default_factory=list)
    dispatch_lag_ms: list[float] = field(default_factory=list)
    tokens_per_s_per_user: list[float] = field(default_factory=list)

    def extend(self, other: StepValues) -> None:
        """Pool ``other`` into this one (re-measurements at one load)."""
        self.requests += other.requests
        self.failed += other.failed
        self.output_tokens += other.output_tokens
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "per_request"):
            getattr(self, name).extend(getattr(other, name))
        self.dispatch_lag_ms.extend(other.dispatch_lag_ms)
        self.tokens_per_s_per_user.extend(other.tokens_per_s_per_user)

    def metric(self, name: str) -> list[float]:
        """The values of ``ttft_ms`` / ``tpot_ms`` / ``itl_ms`` / ``e2el_ms``."""
        values: list[float] = getattr(self, name)
        return values


def step_values(records: Sequence[RequestRecord]) -> StepValues:
    """Per-request values (ms) of a step's records, ``vllm bench serve`` definitions.

    Warm-up records are ignored. A request is successful when ``success`` is set and it
    has a TTFT and an E2EL (as :func:`jobs.loadgen.summarize`); any other is failed.
    TPOT = ``(E2EL - TTFT) / (output_tokens - 1)`` as recorded in ``tpot_s``; ITL the
    recorded gaps. Source: vLLM ``vllm/benchmarks/serve.py`` ``calculate_metrics``.
    """
    out = StepValues()
    for r in records:
        if r.warmup:
            continue
        out.requests += 1
        if r.scheduled_s is not None:
            out.dispatch_lag_ms.append((r.start_s - r.scheduled_s) * 1000.0)
        if not (r.success and r.ttft_s is not None and r.e2el_s is not None):
            out.failed += 1
            out.per_request.append(None)
            continue
        ttft, e2el = _finite_ms(r.ttft_s), _finite_ms(r.e2el_s)
        if ttft is None or e2el is None:  # a value that cannot be a latency: not measured
            out.failed += 1
            out.per_request.append(None)
            continue
        out.ttft_ms.append(ttft)
        out.e2el_ms.append(e2el)
        tpot = _finite_ms(r.tpot_s)
        if tpot is not None:
            out.tpot_ms.append(tpot)
        out.itl_ms.extend(g for g in (_finite_ms(gap) for gap in r.itl_s) if g is not None)
        out.per_request.append((ttft, tpot or 0.0, e2el))
        tokens = r.output_tokens or 0
        out.output_tokens += tokens
        if tokens and e2el > ttft:
            out.tokens_per_s_per_user.append(tokens / ((e2el - ttft) / 1000.0))
    return out


def _finite_ms(value_s: float | None) -> float | None:
    """Seconds to ms; ``None`` for a missing, negative or non-finite value."""
    if value_s is None or not math.isfinite(value_s) or value_s < 0:
        return None
    return value_s * 1000.0


def percentile_interval(
    sorted_values: np.ndarray, q: float, confidence: float
) -> tuple[float | None, float | None]:
    """Distribution-free interval of the ``q``-th percentile from order statistics.

    The number of values under the true percentile is Binomial(n, q/100), so the
    ``l``-th smallest value is at or under it with probability P(B >= l) and the
    ``u``-th at or over it with probability P(B <= u - 1). The interval is the widest
    ``l`` and narrowest ``u`` that keep each tail within ``(1 - confidence) / 2``.
    ``None`` where no order statistic reaches that confidence: a p99 over 20 values
    has no upper bound (it can only fail, never pass); 368 values are needed at
    95 %. No resampling: a bootstrap of a high percentile of few values never goes
    above their maximum and passes far too often.
    """
    n = len(sorted_values)
    if n == 0:
        return None, None
    p = q / 100.0
    alpha = (1.0 - confidence) / 2.0
    k = np.arange(n + 1, dtype=float)
    log_pmf = (
        math.lgamma(n + 1)
        - np.array([math.lgamma(x + 1) + math.lgamma(n - x + 1) for x in k])
        + k * math.log(p)
        + (n - k) * math.log1p(-p)
    )
    cdf = np.cumsum(np.exp(log_pmf))
    below = int(np.count_nonzero(cdf[:n] <= alpha))  # l = below: P(B <= l - 1) <= alpha
    low = float(sorted_values[below - 1]) if below >= 1 else None
    reach = np.flatnonzero(cdf[:n] >= 1.0 - alpha)  # u - 1 = first j with P(B <= j) >= 1-a
    high = float(sorted_values[int(reach[0])]) if reach.size else None
    return low, high


def min_requests_to_pass(q: float, confidence: float) -> int:
    """The fewest values whose :func:`percentile_interval` of the ``q``-th percentile has
    an upper end: ``1 - (q/100)**n >= 1 - (1 - confidence) / 2``. With fewer, a step can
    fail that objective but never pass it (p99 at 95 %: 368; p90: 36; p50: 6)."""
    alpha = (1.0 - confidence) / 2.0
    return max(1, math.ceil(math.log(alpha) / math.log(q / 100.0) - 1e-9))


def proportion_interval(good: int, n: int, confidence: float) -> tuple[float, float]:
    """Wilson score interval of a proportion (good of n), two-sided at ``confidence``."""
    z = NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2.0)
    phat = good / n
    denom = 1.0 + z * z / n
    centre = (phat + z * z / (2 * n)) / denom
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _check_percentile(
    metric: SLOMetric,
    name: str,
    objective: float,
    values: StepValues,
    confidence: float,
) -> SLOCheck:
    data = np.sort(np.asarray(values.metric(metric), dtype=float))
    check = SLOCheck(metric=metric, percentile=name, objective=objective, verdict="uncertain")
    if data.size == 0:  # no value: pass when requests succeeded (a TPOT with one token)
        if values.requests == 0:
            return check  # nothing measured: no verdict
        check.verdict = "pass" if values.requests > values.failed else "fail"
        return check
    q = percentile_of(name)
    check.value = float(np.percentile(data, q))
    check.ci_low, check.ci_high = percentile_interval(data, q, confidence)
    if check.ci_high is not None and check.ci_high <= objective:
        check.verdict = "pass"
    elif check.ci_low is not None and check.ci_low > objective:
        check.verdict = "fail"
    return check


def _good(values: StepValues, slos: dict[SLOMetric, dict[str, float]]) -> np.ndarray:
    """0/1 per measured request: every per-request objective met (failed: 0)."""
    limits = {m: min(objs.values()) for m, objs in slos.items() if objs and m != "itl_ms"}
    position = {"ttft_ms": 0, "tpot_ms": 1, "e2el_ms": 2}
    good = [
        1.0
        if row is not None and all(row[position[m]] <= limit for m, limit in limits.items())
        else 0.0
        for row in values.per_request
    ]
    return np.asarray(good, dtype=float)


def _check_goodput(objective: float, good: np.ndarray, confidence: float) -> SLOCheck:
    check = SLOCheck(metric="goodput", objective=objective, verdict="uncertain")
    if good.size == 0:
        return check  # nothing measured: no verdict
    check.value = float(good.mean())
    check.ci_low, check.ci_high = proportion_interval(int(good.sum()), good.size, confidence)
    check.verdict = (
        "pass"
        if check.ci_low >= objective
        else "fail"
        if check.ci_high < objective
        else "uncertain"
    )
    return check


def _excess(check: SLOCheck) -> float:
    if check.value is None:
        return math.inf
    if check.metric == "goodput":
        return check.objective / check.value if check.value > 0 else math.inf
    return check.value / check.objective


def _end(value: float | None) -> str:
    """An interval end for a note: ``None`` is unbounded (too few requests to bound it)."""
    return "unbounded" if value is None else f"{value:.4g}"


def _name(check: SLOCheck) -> str:
    return "goodput" if check.metric == "goodput" else f"{check.metric}:{check.percentile}"


class CapacitySearch:
    """The capacity search, one step at a time (see the module docstring for the rules).

    Drive it with ``while (load := search.next_load()) is not None: ...
    search.record(load, records, signals, duration_s)``, then :meth:`result`; or use
    :func:`run_search`. Deterministic given the records (no randomness).
    """

    def __init__(self, spec: CapacitySpec) -> None:
        self.spec = spec
        self._steps: list[CapacityStep] = []
        self._lo: float | None = None  # highest passing load
        self._hi: float | None = None  # lowest failing load
        self._binding: str | None = None  # at the lowest failing load
        self._pending: float | None = None  # a load to measure again
        self._pooled: dict[float, tuple[int, StepValues]] = {}
        self._status: SearchStatus | None = None
        self._note: str | None = None
        self._tried_max = False
        if spec.variable == "concurrency":
            self._min, self._max = float(math.ceil(spec.min)), float(math.floor(spec.max))
        else:
            self._min, self._max = spec.min, spec.max

    # -- driving ------------------------------------------------------------------------

    def next_load(self) -> float | None:
        """The next load to measure (requests/s, or an integer concurrency); None: done."""
        if self._status is not None:
            return None
        if (
            self._pending is None
            and self._tried_max
            and self._lo is not None
            and self._hi is not None
            and self._converged(self._lo, self._hi)
        ):  # narrowed enough, even on the last allowed step
            self._finish("found", None)
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
                self._finish("at_least_max", None)
                return None
            return self._max
        lo, hi = self._lo, self._hi
        assert lo is not None and hi is not None  # min passed and max failed
        if self._converged(lo, hi):
            self._finish("found", None)
            return None
        if self.spec.variable == "concurrency":
            return float((int(lo) + int(hi)) // 2)
        return math.sqrt(lo * hi)

    def _converged(self, lo: float, hi: float) -> bool:
        if self.spec.variable == "concurrency":
            return hi - lo <= 1
        return (hi - lo) / lo <= self.spec.tolerance

    def record(
        self,
        load: float,
        records: Sequence[RequestRecord],
        signals: StepSignals,
        duration_s: float | None = None,
    ) -> CapacityStep:
        """Decide one measured step at ``load`` and move the search on.

        Args:
            load: the load measured (the value :meth:`next_load` gave).
            records: the step's measured :class:`~jobs.schemas.RequestRecord` (warm-ups
                are ignored).
            signals: the server's and client's signals during the step.
            duration_s: the step's measured wall time (for the throughputs).

        Returns:
            The step as stored (also in :meth:`result`'s ``steps``).

        Raises:
            RuntimeError: the search is over.
        """
        if self._status is not None:
            raise RuntimeError("the capacity search is over")
        own = step_values(records)
        count, pooled = self._pooled.get(load, (0, StepValues()))
        pooled.extend(own)
        count += 1
        self._pooled[load] = (count, pooled)
        step = self._step(load, own, pooled, count, signals, duration_s)
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
        else:
            interval = (self._lo, self._hi)
        note = self._note if self._status is not None else "the search has not finished"
        return CapacityResult(
            variable=self.spec.variable,
            status=status,
            capacity=capacity,
            interval=interval,
            binding_slo=self._binding,
            steps=list(self._steps),
            note=note,
        )

    # -- deciding -----------------------------------------------------------------------

    def _step(
        self,
        load: float,
        own: StepValues,
        pooled: StepValues,
        count: int,
        signals: StepSignals,
        duration_s: float | None,
    ) -> CapacityStep:
        index = len(self._steps)
        if signals.dispatch_lag_p99_ms is None and own.dispatch_lag_ms:
            lag = float(np.percentile(own.dispatch_lag_ms, 99))
            signals = signals.model_copy(update={"dispatch_lag_p99_ms": lag})
        checks: list[SLOCheck] = []
        for metric in _METRICS:
            for name, objective in self.spec.slos.get(metric, {}).items():
                checks.append(
                    _check_percentile(metric, name, objective, pooled, self.spec.confidence)
                )
        good = _good(pooled, self.spec.slos)
        if self.spec.goodput is not None:
            checks.append(_check_goodput(self.spec.goodput, good, self.spec.confidence))
        saturated = self._saturation(load, own, signals)
        verdicts = {c.verdict for c in checks}
        verdict: Verdict = (
            "uncertain"
            if pooled.requests == 0  # nothing measured (no request, or warm-up only)
            else "fail"
            if saturated or "fail" in verdicts
            else "uncertain"
            if "uncertain" in verdicts
            else "pass"
        )
        own_good = _good(own, self.spec.slos)
        return CapacityStep(
            index=index,
            load=load,
            requests=own.requests,
            failed=own.failed,
            duration_s=duration_s,
            percentiles=self._percentiles(own),
            goodput=float(own_good.mean()) if own_good.size else None,
            output_tokens_per_s=own.output_tokens / duration_s if duration_s else None,
            output_tokens_per_s_per_user=(
                float(np.mean(own.tokens_per_s_per_user)) if own.tokens_per_s_per_user else None
            ),
            signals=signals,
            checks=checks,
            saturated=saturated,
            verdict=verdict,
            measurements=count,
        )

    def _percentiles(self, values: StepValues) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for metric in _METRICS:
            data = values.metric(metric)
            if not data:
                continue
            names = sorted(
                {*REPORTED_PERCENTILES, *self.spec.slos.get(metric, {})}, key=percentile_of
            )
            out[metric] = {n: float(np.percentile(data, percentile_of(n))) for n in names}
        return out

    def _saturation(self, load: float, values: StepValues, signals: StepSignals) -> str | None:
        """Why the step counts as saturated (None: it does not); rules in the module doc."""
        if values.requests and values.failed > SATURATION_FAILED_FRACTION * values.requests:
            return f"{values.failed} of {values.requests} requests failed"
        if self.spec.variable != "request_rate":
            return None
        first, last, most = signals.waiting_first, signals.waiting_last, signals.waiting_max
        if first is not None and last is not None and most is not None and most > 0:
            threshold = max(1.0, SATURATION_WAITING_FRACTION * values.requests)
            if last - first > threshold:
                return (
                    f"waiting requests grew from {first:g} to {last:g} through the step "
                    f"(threshold {threshold:g})"
                )
        lag = signals.dispatch_lag_p99_ms
        if lag is not None:
            threshold = max(DISPATCH_LAG_FLOOR_MS, 2 * 1000.0 / load)
            if lag > threshold:
                return f"client dispatch lag p99 {lag:.1f} ms over {threshold:.1f} ms"
        return None

    def _advance(self, load: float, step: CapacityStep, count: int) -> None:
        if step.verdict == "uncertain":
            if count <= self.spec.remeasure:
                self._pending = load
                return
            straddling = [c for c in step.checks if c.verdict == "uncertain"]
            what = "; ".join(
                f"{_name(c)} interval [{_end(c.ci_low)}, {_end(c.ci_high)}] "
                f"straddles {c.objective:g}"
                for c in straddling
            )
            self._finish("uncertain", f"at load {load:g} after {count} measurement(s): {what}")
            return
        self._pending = None
        if step.verdict == "pass":
            self._lo = load if self._lo is None else max(self._lo, load)
        else:
            if self._hi is None or load < self._hi:
                self._hi = load
                self._binding = self._binding_of(step)
        if load == self._min and not self._tried_max:
            if step.verdict == "fail":
                self._finish("below_min", f"the objectives fail at min load {load:g}")
            return
        if load == self._max:
            self._tried_max = True
            if step.verdict == "pass":
                self._finish("at_least_max", f"every objective holds at max load {load:g}")

    def _binding_of(self, step: CapacityStep) -> str:
        failed = [c for c in step.checks if c.verdict == "fail"]
        if not failed:
            return "saturated"
        return _name(max(failed, key=_excess))

    def _finish(self, status: SearchStatus, note: str | None) -> None:
        self._status = status
        if note is not None:
            self._note = note
        elif status == "found":
            self._note = None
        self._pending = None


def run_search(
    spec: CapacitySpec,
    step: Callable[[float], tuple[Sequence[RequestRecord], StepSignals, float | None]],
) -> CapacityResult:
    """Run a whole capacity search: ``step(load)`` measures one step.

    Args:
        spec: what to search.
        step: measures one step at ``load`` (requests/s, or an integer concurrency as a
            float) and returns ``(records, signals, duration_s)``: the step's measured
            records, its signals, and its wall time in seconds (or None).

    Returns:
        The :class:`CapacityResult` (``len(result.steps)`` steps were measured).
    """
    search = CapacitySearch(spec)
    while (load := search.next_load()) is not None:
        records, signals, duration_s = step(load)
        search.record(load, records, signals, duration_s)
    return search.result()
