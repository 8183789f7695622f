"""Compare a variant's runs with its reference's runs: effect sizes, bootstrap CIs, findings.

Pure functions: no database, no Ray, no FastAPI. Inputs are :class:`RunData`
(one repeat of one variant, with its per-request timings and its summary
metrics); outputs are pydantic models whose ``model_dump()`` is JSON-safe
(no NaN, no infinity).

What is compared (:data:`METRICS`):

- **request-level** metrics (TTFT, TPOT, ITL, E2EL at p50/p90/p99, in ms) are
  recomputed from the *pooled* requests of all repeats of a side: warm-up
  requests and failed requests are excluded (as ``vllm bench serve`` does);
  ITL pools the inter-token gaps of every request. Percentiles use linear
  interpolation (``numpy.percentile``), as ``vllm bench serve`` does.
- **run-level** metrics (throughputs, goodput, prefix cache hit rate, KV
  cache usage peak, waiting-queue peak, and on GPUs the energy per output token
  and mean power per GPU) come from each repeat's summary
  metrics; a side's value is the mean over its repeats.

Metric definitions follow vLLM's ``vllm bench serve``
(``vllm/benchmarks/serve.py``: ``calculate_metrics``) and, for server-side
numbers, :func:`jobs.signals.enginemetrics.summarize_samples` (``/metrics`` counter deltas).

Uncertainty:

- request-level CIs use a **hierarchical (cluster) bootstrap**: in every
  draw, each side independently resamples its repeats with replacement, then
  resamples the requests within each chosen repeat with replacement; the
  statistic is computed on the pooled resample, and the ratio
  variant / reference is taken per draw. This keeps the run-to-run variance
  that a flat request bootstrap would hide (Saravanan, Berman & Sober 2020,
  "Application of the hierarchical bootstrap to multi-level data in
  neuroscience", Neurons, Behavior, Data analysis and Theory 3(5); Davison &
  Hinkley 1997, "Bootstrap Methods and their Application", section 3.8).
- run-level CIs bootstrap the repeats only (one value per repeat).
- intervals are **percentile bootstrap** intervals (Efron & Tibshirani 1993,
  "An Introduction to the Bootstrap", chapter 13).

Random numbers come from ``numpy.random.Generator(PCG64(seed))``: the same
inputs and seed give the same output. Bootstrap percentiles are computed
exactly on every resample (see :func:`orchestrator.analysis.bootstrap.weighted_quantiles`),
vectorised over the draws: 2000 draws of 3 repeats x 200 requests per side take well
under a second. A level's own estimates (one side, no reference) are
:mod:`orchestrator.analysis.estimates`.

Note: pooled request-level percentiles are *not* the mean of the per-run
``median_ttft_ms`` etc. stored with each run; they are the percentile of all
measured requests of a side.

Diagnoses drawn from the comparisons are in :mod:`orchestrator.analysis.findings`; the
flat table of run rows for export (CSV / Parquet) in :mod:`orchestrator.analysis.export`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field

from orchestrator.analysis.bootstrap import (
    MIN_REQUEST_VALUES,
    Effect,
    FloatArray,
    IntArray,
    all_equal,
    check_args,
    effect,
    finite_float,
    hierarchical_counts,
    run_effect,
    weighted_quantiles,
)
from orchestrator.analysis.trust import USABLE_STATUSES, SidesTrust, sides_trust

Direction = Literal["lower_is_better", "higher_is_better", "neutral"]
Verdict = Literal[
    "better",
    "worse",
    "higher",
    "lower",
    "no clear difference",
    "insufficient data",
    "untrusted",
    "not applicable",
]
Level = Literal["request", "run"]


# --------------------------------------------------------------------------- inputs


class RunData(BaseModel):
    """One repeat of one variant, as needed for a comparison.

    ``requests``: one dict per request, keys (seconds / token counts, as in
    :class:`jobs.schemas.RequestRecord`): ``ttft_s``, ``tpot_s``, ``e2el_s``
    (float or None), ``itl_s`` (list of float: gaps between streamed chunks),
    ``output_tokens``, ``prompt_tokens`` (int or None), ``success`` (bool),
    ``warmup`` (bool), optional ``request_class`` (str, e.g. ``"short"`` /
    ``"long"``). ``metrics``: the run's summary (names as ``vllm bench
    serve`` plus :func:`jobs.signals.enginemetrics.summarize_samples`). ``devices``: devices
    the run reserved (TP x PP x replicas). ``changed``: dotted path -> value
    where this run differs from its reference (``{}`` for the baseline).
    ``cache_contamination``: the status of the run's warm-cache check
    (``engine_info["cache_contamination"]["status"]``, :mod:`jobs.signals.cachecheck`):
    ``"contaminated"`` when its measured phase began on a warm prefix cache; None when
    the run has no check. ``not_applicable``: metric -> why the run cannot have it
    (``{"prefix_cache_hit_rate": "off"}``, :func:`orchestrator.analysis.trust.not_applicable_of`).
    ``goodput_objectives``: the latencies its goodput counts (``["ttft", "tpot"]``; None:
    unknown). What these flags taint: :mod:`orchestrator.analysis.trust`.
    """

    run_id: str
    variant: str
    repeat_index: int = 0
    status: str = "succeeded"
    metrics: dict[str, float] = Field(default_factory=dict)
    requests: list[dict[str, Any]] = Field(default_factory=list)
    devices: int = Field(1, ge=1)
    changed: dict[str, Any] = Field(default_factory=dict)
    cache_contamination: Literal["clean", "contaminated", "unknown"] | None = None
    not_applicable: dict[str, str] = Field(default_factory=dict)
    goodput_objectives: list[str] | None = None


class ChangedVariable(BaseModel):
    """The one variable a variant changes vs its reference.

    ``paths``: dotted spec paths it touches (e.g.
    ``["layout.tensor_parallel_size"]``). ``reference_value`` /
    ``variant_value``: the values; when ``paths`` has several entries they may
    be dicts keyed by path.
    """

    name: str
    paths: list[str] = Field(default_factory=list)
    reference_value: Any = None
    variant_value: Any = None


class VariantRef(BaseModel):
    """``variant`` is compared with ``reference`` (``changed`` is None for the baseline)."""

    variant: str
    reference: str
    changed: ChangedVariable | None = None


# --------------------------------------------------------------------------- metric table


@dataclass(frozen=True)
class MetricSpec:
    """One compared metric.

    ``level="request"``: ``field`` is a per-request key in seconds (``itl_s``
    is a list of gaps) and ``quantile`` in [0, 1]; the value is reported in
    ms. ``level="run"``: ``name`` is a key of :attr:`RunData.metrics`.
    """

    name: str
    unit: str
    direction: Direction
    level: Level
    field: str | None = None
    quantile: float | None = None


def _request_metrics() -> list[MetricSpec]:
    out: list[MetricSpec] = []
    for short in ("ttft", "tpot", "itl", "e2el"):
        for label, q in (("median", 0.5), ("p90", 0.9), ("p99", 0.99)):
            out.append(
                MetricSpec(
                    name=f"{label}_{short}_ms",
                    unit="ms",
                    direction="lower_is_better",
                    level="request",
                    field=f"{short}_s",
                    quantile=q,
                )
            )
    return out


#: Every compared metric, in report order. Names follow ``vllm bench serve``
#: (request-level, throughputs, goodput) and :func:`jobs.signals.enginemetrics.summarize_samples`.
METRICS: tuple[MetricSpec, ...] = (
    *_request_metrics(),
    MetricSpec("output_throughput", "tok/s", "higher_is_better", "run"),
    MetricSpec("request_throughput", "req/s", "higher_is_better", "run"),
    MetricSpec("total_token_throughput", "tok/s", "higher_is_better", "run"),
    MetricSpec("request_goodput", "req/s", "higher_is_better", "run"),
    MetricSpec("goodput_fraction", "fraction", "higher_is_better", "run"),
    MetricSpec("prefix_cache_hit_rate", "fraction", "higher_is_better", "run"),
    MetricSpec("kv_cache_usage_peak", "fraction", "neutral", "run"),
    MetricSpec("num_requests_waiting_peak", "requests", "lower_is_better", "run"),
    # the server's view, from /metrics histogram deltas
    # (jobs.signals.enginemetrics.summarize_histograms)
    MetricSpec("server_mean_queue_ms", "ms", "lower_is_better", "run"),
    MetricSpec("server_mean_prefill_ms", "ms", "lower_is_better", "run"),
    MetricSpec("server_mean_decode_ms", "ms", "lower_is_better", "run"),
    # GPU telemetry over the measured phase (jobs.signals.gpus.summarize_gpu_samples): absent on CPU
    # hosts, so compared only where both sides ran on GPUs
    MetricSpec("energy_per_output_token_j", "J/token", "lower_is_better", "run"),
    MetricSpec("gpu_mean_power_w", "W", "neutral", "run"),
    MetricSpec("gpu_mean_utilization_pct", "%", "neutral", "run"),
)
METRICS_BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}


# --------------------------------------------------------------------------- outputs


class MetricComparison(BaseModel):
    """Variant vs reference on one metric (JSON-safe: no NaN/inf).

    ``reference`` / ``variant``: point estimates on all data, in ``unit``
    (request-level: the percentile of the pooled requests; run-level: the
    mean over repeats). ``ratio`` = variant / reference (None when the
    reference is 0). ``difference`` = variant - reference. ``ci_low`` /
    ``ci_high``: percentile-bootstrap interval at ``confidence`` of the ratio
    (``ci_of="ratio"``) or, when the ratio is undefined in the point estimate
    or in some draw, of the difference (``ci_of="difference"``); all three are
    None when no CI could be computed. ``n_requests``: measured successful
    requests with a value, both sides (None for run-level metrics).
    ``trustworthy``: False when a finding flags the metric for a compared run (token
    bursts for TPOT/ITL, a warm prefix cache, ...: :mod:`orchestrator.analysis.trust`);
    ``untrusted_reason`` names the runs and why. Such a row keeps its values (shown
    greyed) and has verdict ``untrusted``: no ratio, difference or interval.
    ``not_applicable``: the sides that cannot have the metric (``{"reference": "off"}``:
    prefix caching off has no hit rate, never 0); their value is None and the verdict
    ``not applicable``, with no ratio, difference or interval.
    """

    metric: str
    unit: str
    direction: Direction
    level: Level
    reference: float | None
    variant: float | None
    ratio: float | None
    difference: float | None
    ci_low: float | None = None
    ci_high: float | None = None
    ci_of: Literal["ratio", "difference"] | None = None
    confidence: float
    n_reference_repeats: int
    n_variant_repeats: int
    n_requests: int | None = None
    n_reference_requests: int | None = None
    n_variant_requests: int | None = None
    verdict: Verdict
    trustworthy: bool = True
    untrusted_reason: str | None = None
    not_applicable: dict[str, str] = Field(default_factory=dict)


# --------------------------------------------------------------------------- helpers


def usable_runs(runs: Iterable[RunData]) -> list[RunData]:
    """The runs whose data is compared (status in :data:`USABLE_STATUSES`)."""
    return [r for r in runs if r.status in USABLE_STATUSES]


def measured_requests(run: RunData) -> list[dict[str, Any]]:
    """Successful, non-warm-up requests with a TTFT and an E2EL (as ``summarize``)."""
    return [
        q
        for q in run.requests
        if q.get("success")
        and not q.get("warmup")
        and finite_float(q.get("ttft_s")) is not None
        and finite_float(q.get("e2el_s")) is not None
    ]


@dataclass
class Side:
    """The measured requests of one side, concatenated repeat after repeat."""

    sizes: list[int]
    requests: list[dict[str, Any]]

    @property
    def n_repeats(self) -> int:
        return len(self.sizes)


def side_of(runs: Sequence[RunData], keep: Mapping[str, str] | None = None) -> Side:
    """Repeats with >= 1 measured request; ``keep``: only requests whose keys match."""
    sizes: list[int] = []
    requests: list[dict[str, Any]] = []
    for run in usable_runs(runs):
        reqs = measured_requests(run)
        if keep:
            reqs = [q for q in reqs if all(q.get(k) == v for k, v in keep.items())]
        if reqs:
            sizes.append(len(reqs))
            requests.extend(reqs)
    return Side(sizes, requests)


def field_values(side: Side, field: str) -> tuple[FloatArray, IntArray]:
    """(values in s, index of the owning request), dropping missing/non-finite values."""
    chunks: list[FloatArray] = []
    for q in side.requests:
        raw = q.get(field)
        items = raw if isinstance(raw, list | tuple) else [raw]
        try:
            arr = np.asarray(items, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            arr = np.asarray(
                [v for v in map(finite_float, items) if v is not None], dtype=np.float64
            )
        chunks.append(arr)
    if not chunks:
        return np.zeros(0, dtype=np.float64), np.zeros(0, dtype=np.int64)
    lengths = np.asarray([c.size for c in chunks], dtype=np.int64)
    values = np.concatenate(chunks)
    owner = np.repeat(np.arange(len(chunks), dtype=np.int64), lengths)
    keep = np.isfinite(values)
    return values[keep], owner[keep]


def run_values(runs: Sequence[RunData], name: str) -> FloatArray:
    vals = [finite_float(r.metrics.get(name)) for r in usable_runs(runs)]
    return np.asarray([v for v in vals if v is not None], dtype=np.float64)


def _verdict(direction: Direction, side: str) -> Verdict:
    if side == "unknown":
        return "insufficient data"
    if side == "neither":
        return "no clear difference"
    below = side == "below"
    if direction == "lower_is_better":
        return "better" if below else "worse"
    if direction == "higher_is_better":
        return "worse" if below else "better"
    return "lower" if below else "higher"


def _comparison(
    spec: MetricSpec,
    eff: Effect,
    confidence: float,
    n_ref: int,
    n_var: int,
    n_ref_req: int | None = None,
    n_var_req: int | None = None,
) -> MetricComparison | None:
    """The output row; None when a point estimate overflowed (not JSON-safe)."""
    if not (math.isfinite(eff.reference) and math.isfinite(eff.variant)):
        return None
    n_req = None if n_ref_req is None or n_var_req is None else n_ref_req + n_var_req
    return MetricComparison(
        metric=spec.name,
        unit=spec.unit,
        direction=spec.direction,
        level=spec.level,
        reference=eff.reference,
        variant=eff.variant,
        ratio=eff.ratio,
        difference=eff.difference,
        ci_low=eff.ci[0] if eff.ci else None,
        ci_high=eff.ci[1] if eff.ci else None,
        ci_of=eff.ci_of,
        confidence=confidence,
        n_reference_repeats=n_ref,
        n_variant_repeats=n_var,
        n_requests=n_req,
        n_reference_requests=n_ref_req,
        n_variant_requests=n_var_req,
        verdict=_verdict(spec.direction, eff.side()),
    )


def request_effects(
    ref: Side,
    var: Side,
    field: str,
    quantiles: Sequence[float],
    ref_counts: FloatArray,
    var_counts: FloatArray,
    confidence: float,
    scale: float = 1000.0,
) -> tuple[list[Effect], int, int] | None:
    """Effects of ``field`` at each quantile (values x ``scale``); None if a side has no data."""
    rv, ro = field_values(ref, field)
    vv, vo = field_values(var, field)
    if rv.size == 0 or vv.size == 0:
        return None
    rv, vv = rv * scale, vv * scale
    enough = rv.size >= MIN_REQUEST_VALUES and vv.size >= MIN_REQUEST_VALUES
    r_draws = weighted_quantiles(rv, ro, ref_counts, quantiles) if enough else None
    v_draws = weighted_quantiles(vv, vo, var_counts, quantiles) if enough else None
    effects = []
    for k, q in enumerate(quantiles):
        eff = effect(
            float(np.percentile(rv, 100.0 * q)),
            float(np.percentile(vv, 100.0 * q)),
            None if r_draws is None else r_draws[:, k],
            None if v_draws is None else v_draws[:, k],
            confidence,
        )
        eff.identical = all_equal(rv, vv)
        effects.append(eff)
    return effects, int(rv.size), int(vv.size)


# --------------------------------------------------------------------------- compare


def compare_variant(
    variant_runs: Sequence[RunData],
    reference_runs: Sequence[RunData],
    *,
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> list[MetricComparison]:
    """Compare a variant's repeats with its reference's on every metric of :data:`METRICS`.

    Args:
        variant_runs, reference_runs: the repeats of each side; runs whose
            status is not ``succeeded`` are ignored.
        n_boot: bootstrap draws (>= 1).
        seed: seed of ``numpy.random.Generator(PCG64(seed))``.
        confidence: two-sided level of the percentile intervals, in (0, 1).

    Returns:
        One :class:`MetricComparison` per metric present on both sides, in
        :data:`METRICS` order (metrics missing on either side are omitted).
        Request-level: pooled percentiles (ms) and a hierarchical bootstrap
        (repeats, then requests within each chosen repeat; Saravanan et al.
        2020). A side with a single repeat still gets a CI, which then only
        reflects request-to-request variation. Run-level: mean over repeats and
        a bootstrap over repeats; with fewer than :data:`MIN_RUN_REPEATS`
        repeats on a side there is no CI and the verdict is
        ``"insufficient data"`` unless every value on both sides is identical
        (then ``"no clear difference"``). Verdict: CI entirely below 1 (ratio)
        or 0 (difference) -> ``better`` for lower-is-better metrics, ``worse``
        for higher-is-better, ``lower`` for neutral ones; entirely above -> the
        opposite; otherwise ``"no clear difference"``.

    No verdict from an untrustworthy number: a metric a flag of a compared run taints
    (:mod:`orchestrator.analysis.trust`: token bursts for TPOT/ITL, a warm prefix cache
    for every metric, ...) is ``trustworthy=False`` with ``untrusted_reason``, verdict
    ``untrusted`` and no ratio, difference or interval. A run-level metric a side cannot
    have (prefix caching off) is a ``not applicable`` row, its value None, never 0.

    Raises:
        ValueError: ``n_boot`` < 1 or ``confidence`` outside (0, 1).
    """
    check_args(n_boot, confidence)
    rng = np.random.Generator(np.random.PCG64(seed))
    out = _request_rows(rng, variant_runs, reference_runs, n_boot, confidence)
    trust = sides_trust(variant_runs, reference_runs)
    for spec in METRICS:
        if spec.level != "run":
            continue
        rv, vv = run_values(reference_runs, spec.name), run_values(variant_runs, spec.name)
        na = trust.not_applicable(spec.name)
        if na:
            out.append(_not_applicable(spec, rv, vv, na, confidence))
            continue
        if rv.size == 0 or vv.size == 0:
            continue
        eff = run_effect(rng, rv, vv, n_boot, confidence)
        row = _comparison(spec, eff, confidence, int(rv.size), int(vv.size))
        if row is not None:
            out.append(row)

    order = {m.name: i for i, m in enumerate(METRICS)}
    out.sort(key=lambda c: order[c.metric])
    return [_withhold(c, trust) for c in out]


def by_field(specs: Iterable[MetricSpec]) -> dict[str, list[MetricSpec]]:
    """The request-level metrics grouped by the request field they are percentiles of."""
    fields: dict[str, list[MetricSpec]] = {}
    for spec in specs:
        if spec.level == "request" and spec.field is not None:
            fields.setdefault(spec.field, []).append(spec)
    return fields


def quantiles_of(specs: Sequence[MetricSpec]) -> list[float]:
    return [s.quantile if s.quantile is not None else 0.5 for s in specs]


def _request_rows(
    rng: np.random.Generator,
    variant_runs: Sequence[RunData],
    reference_runs: Sequence[RunData],
    n_boot: int,
    confidence: float,
) -> list[MetricComparison]:
    """The request-level rows: pooled percentiles and a hierarchical bootstrap."""
    out: list[MetricComparison] = []
    ref_side, var_side = side_of(reference_runs), side_of(variant_runs)
    if not (ref_side.requests and var_side.requests):
        return out
    ref_counts = hierarchical_counts(rng, ref_side.sizes, n_boot)
    var_counts = hierarchical_counts(rng, var_side.sizes, n_boot)
    for field, specs in by_field(METRICS).items():
        qs = quantiles_of(specs)
        res = request_effects(ref_side, var_side, field, qs, ref_counts, var_counts, confidence)
        if res is None:
            continue
        effects, n_ref_req, n_var_req = res
        counts = (ref_side.n_repeats, var_side.n_repeats, n_ref_req, n_var_req)
        for spec, eff in zip(specs, effects, strict=True):
            row = _comparison(spec, eff, confidence, *counts)
            if row is not None:
                out.append(row)
    return out


#: What an untrusted or not-applicable row does not carry: no number that compares.
_NO_VERDICT = {"ratio": None, "difference": None, "ci_low": None, "ci_high": None, "ci_of": None}


def _withhold(row: MetricComparison, trust: SidesTrust) -> MetricComparison:
    """``row`` without its verdict when a flag of a compared run taints its metric."""
    reason = trust.reason(row.metric)
    if reason is None:
        return row
    update: dict[str, Any] = {"trustworthy": False, "untrusted_reason": reason}
    if row.verdict != "not applicable":
        update.update(_NO_VERDICT, verdict="untrusted")
    return row.model_copy(update=update)


def _not_applicable(
    spec: MetricSpec, rv: FloatArray, vv: FloatArray, na: dict[str, str], confidence: float
) -> MetricComparison:
    """The row of a run-level metric a side cannot have: that side's value None, no verdict."""
    return MetricComparison(
        metric=spec.name,
        unit=spec.unit,
        direction=spec.direction,
        level=spec.level,
        reference=None if "reference" in na or rv.size == 0 else float(rv.mean()),
        variant=None if "variant" in na or vv.size == 0 else float(vv.mean()),
        confidence=confidence,
        n_reference_repeats=int(rv.size),
        n_variant_repeats=int(vv.size),
        verdict="not applicable",
        not_applicable=na,
        **_NO_VERDICT,
    )
