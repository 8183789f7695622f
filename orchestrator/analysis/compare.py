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
exactly on every resample (see :func:`_weighted_quantiles`), vectorised over
the draws: 2000 draws of 3 repeats x 200 requests per side take well under a
second.

Note: pooled request-level percentiles are *not* the mean of the per-run
``median_ttft_ms`` etc. stored with each run; they are the percentile of all
measured requests of a side.

Diagnoses drawn from the comparisons are in :mod:`orchestrator.analysis.findings`; the
flat table of run rows for export (CSV / Parquet) in :mod:`orchestrator.analysis.export`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, Field

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

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: A side needs at least this many values of a request-level metric for a CI.
MIN_REQUEST_VALUES = 2
#: A run-level CI needs at least this many repeats on *each* side.
MIN_RUN_REPEATS = 2
#: A CI needs at least this fraction of bootstrap draws to be defined.
MIN_DEFINED_DRAWS = 0.5
#: Elements of one block of hierarchical-resampling indices (caps memory).
_DRAW_BLOCK = 2_000_000


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


def finite_float(x: Any) -> float | None:
    """``float(x)`` when it is a finite number, else None."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


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


def _field_values(side: Side, field: str) -> tuple[FloatArray, IntArray]:
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


def hierarchical_counts(rng: np.random.Generator, sizes: Sequence[int], n_boot: int) -> FloatArray:
    """Multiplicity of every request in each of ``n_boot`` hierarchical resamples.

    Shape ``(n_boot, sum(sizes))`` (integers stored as float64; only the
    counts matter for a statistic of the pooled resample). A draw picks
    ``len(sizes)`` repeats with replacement, then for each pick draws as many
    requests as that repeat has, with replacement, from that repeat.
    """
    size = np.asarray(sizes, dtype=np.int64)
    n_rep, n_all, n_max = size.size, int(size.sum()), int(size.max())
    start = np.cumsum(size) - size
    out = np.empty((n_boot, n_all), dtype=np.float64)
    step = max(1, _DRAW_BLOCK // (n_rep * n_max))
    for lo in range(0, n_boot, step):
        rows = min(n_boot, lo + step) - lo
        picks = rng.integers(0, n_rep, size=(rows, n_rep))  # repeat of each slot
        n_pick = size[picks][:, :, None]
        # floor(U * n) is uniform on 0..n-1 (to 2**-53); much faster than integers(0, n_array)
        within = np.minimum(
            (rng.random((rows, n_rep, n_max)) * n_pick).astype(np.int64), n_pick - 1
        )
        valid = np.arange(n_max)[None, None, :] < n_pick
        flat = np.arange(rows)[:, None, None] * n_all + start[picks][:, :, None] + within
        out[lo : lo + rows] = np.bincount(flat[valid], minlength=rows * n_all).reshape(rows, n_all)
    return out


def _weighted_quantiles(
    values: FloatArray, owner: IntArray, counts: FloatArray, quantiles: Sequence[float]
) -> FloatArray:
    """Linear-interpolation quantiles of each resample, shape ``(n_boot, len(quantiles))``.

    Row ``b`` is the multiset where ``values[j]`` occurs ``counts[b, owner[j]]``
    times; the result equals ``numpy.percentile`` of that multiset expanded
    (NaN when the row is empty). Exact, without materialising a
    ``(n_boot, len(values))`` matrix: the sorted values are cut into ``K``
    bins of consecutive ranks; ``counts @ H`` (``H[i, k]`` = values of request
    ``i`` in bin ``k``) gives every draw's weight per bin, which locates the
    bin holding a target rank; only that bin is then scanned.
    """
    n_boot, n_owner = counts.shape
    out = np.full((n_boot, len(quantiles)), np.nan)
    g = values.size
    if g == 0:
        return out
    order = np.argsort(values, kind="stable")
    svals, sowner = values[order], owner[order]
    n_bins = int(min(g, max(1, round(math.sqrt(2000.0 * g / max(n_owner, 1))))))
    edges = np.linspace(0, g, n_bins + 1).round().astype(np.int64)
    widths = np.diff(edges)
    bin_of = np.repeat(np.arange(n_bins, dtype=np.int64), widths)
    per_bin = np.bincount(sowner * n_bins + bin_of, minlength=n_owner * n_bins)
    bin_weights = counts @ per_bin.reshape(n_owner, n_bins).astype(np.float64)  # (B, K)
    cum = np.cumsum(bin_weights, axis=1)
    total = cum[:, -1]
    # Within-bin owners padded to the widest bin; padding points at a zero-weight column.
    width = int(widths.max())
    pos = edges[:-1, None] + np.arange(width, dtype=np.int64)[None, :]
    pad_owner = np.where(pos < edges[1:, None], sowner[np.minimum(pos, g - 1)], n_owner)
    counts_ext = np.concatenate([counts, np.zeros((n_boot, 1))], axis=1)
    last = np.maximum(total - 1.0, 0.0)

    h = np.asarray(quantiles, dtype=np.float64)[None, :] * last[:, None]  # (B, Q)
    lo = np.floor(h)
    rank = np.concatenate([lo, np.minimum(lo + 1.0, last[:, None])], axis=1)  # (B, 2Q)
    # Bin holding each target rank, the weight before it, then the rank inside the bin.
    j = np.minimum((cum[:, None, :] <= rank[:, :, None]).sum(axis=2), n_bins - 1)
    before = np.take_along_axis(cum - bin_weights, j, axis=1)
    flat_idx = pad_owner[j] + (np.arange(n_boot) * (n_owner + 1))[:, None, None]
    inner = np.cumsum(np.take(counts_ext.ravel(), flat_idx), axis=2)  # (B, 2Q, width)
    t = np.minimum((inner <= (rank - before)[:, :, None]).sum(axis=2), width - 1)
    picked = svals[np.minimum(edges[j] + t, g - 1)]
    n_q = len(quantiles)
    v_lo, v_hi = picked[:, :n_q], picked[:, n_q:]
    res = v_lo + (h - lo) * (v_hi - v_lo)
    out[:] = np.where(total[:, None] > 0, res, np.nan)
    return out


def _run_values(runs: Sequence[RunData], name: str) -> FloatArray:
    vals = [finite_float(r.metrics.get(name)) for r in usable_runs(runs)]
    return np.asarray([v for v in vals if v is not None], dtype=np.float64)


def _mean_draws(rng: np.random.Generator, values: FloatArray, n_boot: int) -> FloatArray:
    """Means of ``n_boot`` resamples (with replacement) of ``values``; shape ``(n_boot,)``."""
    idx = rng.integers(0, values.size, size=(n_boot, values.size))
    means: FloatArray = values[idx].mean(axis=1)
    return means


def _interval(draws: FloatArray, confidence: float) -> tuple[float, float] | None:
    """Percentile interval of the finite draws (Efron & Tibshirani 1993, ch. 13)."""
    finite = draws[np.isfinite(draws)]
    if finite.size < max(2, MIN_DEFINED_DRAWS * draws.size):
        return None
    alpha = 1.0 - confidence
    lo, hi = np.percentile(finite, [100.0 * alpha / 2.0, 100.0 * (1.0 - alpha / 2.0)])
    lo_f, hi_f = finite_float(lo), finite_float(hi)
    if lo_f is None or hi_f is None:
        return None
    return lo_f, hi_f


@dataclass
class Effect:
    """Point estimates + CI of variant vs reference (compare's and the findings' bootstraps)."""

    reference: float
    variant: float
    ratio: float | None
    difference: float
    ci: tuple[float, float] | None
    ci_of: Literal["ratio", "difference"] | None
    identical: bool = False  # every value equal on both sides (no CI needed)

    def side(self) -> Literal["below", "above", "neither", "unknown"]:
        """Where the CI lies relative to no effect (ratio 1 / difference 0)."""
        if self.ci is None:
            return "neither" if self.identical else "unknown"
        null = 1.0 if self.ci_of == "ratio" else 0.0
        if self.ci[1] < null:
            return "below"
        if self.ci[0] > null:
            return "above"
        return "neither"


def _effect(
    ref_point: float,
    var_point: float,
    ref_draws: FloatArray | None,
    var_draws: FloatArray | None,
    confidence: float,
) -> Effect:
    ratio = finite_float(var_point / ref_point) if ref_point > 0 else None
    diff = finite_float(var_point - ref_point)
    eff = Effect(ref_point, var_point, ratio, diff if diff is not None else 0.0, None, None)
    if ref_draws is None or var_draws is None:
        return eff
    both = np.isfinite(ref_draws) & np.isfinite(var_draws)
    if ratio is not None and bool(np.all(ref_draws[both] > 0)):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            draws = np.where(both, var_draws / np.where(both, ref_draws, 1.0), np.nan)
        eff.ci, eff.ci_of = _interval(draws, confidence), "ratio"
    else:
        with np.errstate(invalid="ignore", over="ignore"):
            draws = np.where(both, var_draws - ref_draws, np.nan)
        eff.ci, eff.ci_of = _interval(draws, confidence), "difference"
    if eff.ci is None:
        eff.ci_of = None
    return eff


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
    rv, ro = _field_values(ref, field)
    vv, vo = _field_values(var, field)
    if rv.size == 0 or vv.size == 0:
        return None
    rv, vv = rv * scale, vv * scale
    enough = rv.size >= MIN_REQUEST_VALUES and vv.size >= MIN_REQUEST_VALUES
    r_draws = _weighted_quantiles(rv, ro, ref_counts, quantiles) if enough else None
    v_draws = _weighted_quantiles(vv, vo, var_counts, quantiles) if enough else None
    effects = []
    for k, q in enumerate(quantiles):
        eff = _effect(
            float(np.percentile(rv, 100.0 * q)),
            float(np.percentile(vv, 100.0 * q)),
            None if r_draws is None else r_draws[:, k],
            None if v_draws is None else v_draws[:, k],
            confidence,
        )
        eff.identical = _all_equal(rv, vv)
        effects.append(eff)
    return effects, int(rv.size), int(vv.size)


def check_args(n_boot: int, confidence: float) -> None:
    """Raise ValueError unless ``n_boot >= 1`` and ``0 < confidence < 1``."""
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


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
    out: list[MetricComparison] = []

    ref_side, var_side = side_of(reference_runs), side_of(variant_runs)
    if ref_side.requests and var_side.requests:
        ref_counts = hierarchical_counts(rng, ref_side.sizes, n_boot)
        var_counts = hierarchical_counts(rng, var_side.sizes, n_boot)
        fields: dict[str, list[MetricSpec]] = {}
        for spec in METRICS:
            if spec.level == "request" and spec.field is not None:
                fields.setdefault(spec.field, []).append(spec)
        for field, specs in fields.items():
            qs = [s.quantile if s.quantile is not None else 0.5 for s in specs]
            res = request_effects(ref_side, var_side, field, qs, ref_counts, var_counts, confidence)
            if res is None:
                continue
            effects, n_ref_req, n_var_req = res
            counts = (ref_side.n_repeats, var_side.n_repeats, n_ref_req, n_var_req)
            for spec, eff in zip(specs, effects, strict=True):
                row = _comparison(spec, eff, confidence, *counts)
                if row is not None:
                    out.append(row)

    trust = sides_trust(variant_runs, reference_runs)
    for spec in METRICS:
        if spec.level != "run":
            continue
        rv, vv = _run_values(reference_runs, spec.name), _run_values(variant_runs, spec.name)
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


def level_estimates(
    runs: Sequence[RunData],
    *,
    only: Collection[str] | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, dict[str, float | None]]:
    """One level's own value and percentile-bootstrap CI for every metric of ``METRICS``.

    Same estimators as :func:`orchestrator.analysis.compare.compare_variant`, one side
    only: request-level metrics are percentiles (ms) of the pooled measured
    requests of the succeeded repeats, with a hierarchical bootstrap (repeats,
    then requests within each repeat); run-level metrics are the mean over
    repeats, with a bootstrap over repeats when there are at least
    ``MIN_RUN_REPEATS`` of them (else no interval).

    ``only``: compute just these metric names (default: all).

    Returns:
        ``{metric: {"value": float, "ci_low": float | None, "ci_high": float | None}}``;
        metrics without data are absent.
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    out: dict[str, dict[str, float | None]] = {}
    wanted = [m for m in METRICS if only is None or m.name in only]
    side = side_of(runs)
    if side.requests and any(m.level == "request" for m in wanted):
        counts = hierarchical_counts(rng, side.sizes, n_boot)
        fields: dict[str, list[MetricSpec]] = {}
        for spec in wanted:
            if spec.level == "request" and spec.field is not None:
                fields.setdefault(spec.field, []).append(spec)
        for field, specs in fields.items():
            values, owner = _field_values(side, field)
            if values.size == 0:
                continue
            values = values * 1000.0
            qs = [s.quantile if s.quantile is not None else 0.5 for s in specs]
            draws = (
                _weighted_quantiles(values, owner, counts, qs)
                if values.size >= MIN_REQUEST_VALUES
                else None
            )
            for k, (spec, q) in enumerate(zip(specs, qs, strict=True)):
                ci = None if draws is None else _interval(draws[:, k], confidence)
                out[spec.name] = {
                    "value": float(np.percentile(values, 100.0 * q)),
                    "ci_low": ci[0] if ci else None,
                    "ci_high": ci[1] if ci else None,
                }
    for spec in wanted:
        if spec.level != "run":
            continue
        vals = _run_values(runs, spec.name)
        if vals.size == 0:
            continue
        ci = (
            _interval(_mean_draws(rng, vals, n_boot), confidence)
            if vals.size >= MIN_RUN_REPEATS
            else None
        )
        out[spec.name] = {
            "value": float(vals.mean()),
            "ci_low": ci[0] if ci else None,
            "ci_high": ci[1] if ci else None,
        }
    return out


def _all_equal(a: FloatArray, b: FloatArray) -> bool:
    return bool(a.size and b.size and np.all(a == a[0]) and np.all(b == a[0]))


def run_effect(
    rng: np.random.Generator, rv: FloatArray, vv: FloatArray, n_boot: int, confidence: float
) -> Effect:
    """Mean over repeats per side and a bootstrap over repeats (None CI below the minimum)."""
    ref_point, var_point = float(rv.mean()), float(vv.mean())
    if rv.size < MIN_RUN_REPEATS or vv.size < MIN_RUN_REPEATS:
        identical = _all_equal(rv, vv)
        if identical:
            var_point = ref_point
        eff = _effect(ref_point, var_point, None, None, confidence)
        eff.identical = identical
        return eff
    return _effect(
        ref_point,
        var_point,
        _mean_draws(rng, rv, n_boot),
        _mean_draws(rng, vv, n_boot),
        confidence,
    )
