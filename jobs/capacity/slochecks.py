"""The per-objective checks of a capacity step: values, percentile intervals, goodput.

:mod:`jobs.capacity.search` decides a step from these checks (the rules are in its module
docstring):

- **Per-request values** (:func:`step_values`): TTFT, TPOT, ITL and E2EL in ms as
  ``vllm bench serve`` defines them (``jobs.load.loadgen``): percentiles over the
  successful requests (ITL pools every gap of every successful request; TPOT covers
  requests with more than one output token). Failed requests count in the step's
  ``failed`` and in goodput (a failed request is never good).
- **Percentile interval** (:func:`percentile_interval`): a distribution-free interval
  from order statistics (the count of values under the true percentile is binomial);
  :func:`min_requests_to_pass` is the fewest values that can bound a percentile from
  above (p99 at 95 %: 368).
- **Goodput** (:func:`proportion_interval`): the Wilson score interval of the fraction
  of good requests.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel

if TYPE_CHECKING:  # jobs.schemas imports jobs.capacity.search, which imports this module
    from jobs.schemas import RequestRecord

__all__ = [
    "METRICS",
    "REPORTED_PERCENTILES",
    "SLOCheck",
    "SLOMetric",
    "StepValues",
    "check_goodput",
    "check_percentile",
    "excess",
    "interval_end",
    "good_mask",
    "min_requests_to_pass",
    "percentile_interval",
    "percentile_of",
    "proportion_interval",
    "slo_name",
    "step_values",
]

SLOMetric = Literal["ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"]
Verdict = Literal["pass", "fail", "uncertain"]
METRICS: tuple[SLOMetric, ...] = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")

REPORTED_PERCENTILES = ("p50", "p90", "p99")
"""Percentiles every step reports per metric (besides those the objectives name)."""

_PERCENTILE_NAME = re.compile(r"^p(\d+(?:\.\d+)?)$")


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


class SLOCheck(BaseModel):
    """One objective at one step: the percentile, its interval and the verdict."""

    metric: SLOMetric | Literal["goodput"]
    percentile: str | None = None
    objective: float
    value: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    verdict: Verdict


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
    has a TTFT and an E2EL (as :func:`jobs.load.loadgen.summarize`); any other is failed.
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


def check_percentile(
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


def good_mask(values: StepValues, slos: dict[SLOMetric, dict[str, float]]) -> np.ndarray:
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


def check_goodput(objective: float, good: np.ndarray, confidence: float) -> SLOCheck:
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


def excess(check: SLOCheck) -> float:
    if check.value is None:
        return math.inf
    if check.metric == "goodput":
        return check.objective / check.value if check.value > 0 else math.inf
    return check.value / check.objective


def interval_end(value: float | None) -> str:
    """An interval end for a note: ``None`` is unbounded (too few requests to bound it)."""
    return "unbounded" if value is None else f"{value:.4g}"


def slo_name(check: SLOCheck) -> str:
    return "goodput" if check.metric == "goodput" else f"{check.metric}:{check.percentile}"
