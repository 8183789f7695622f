"""The resampling estimators of the comparisons: hierarchical (repeats, then requests)
and flat bootstrap draws, exact weighted quantiles of every draw, percentile intervals,
and the effect of a variant against its reference (ratio or difference, with its CI).

Pure numpy; what is compared and how the rows read is :mod:`orchestrator.analysis.compare`.
Random numbers come from the caller's ``numpy.random.Generator``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

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


def finite_float(x: Any) -> float | None:
    """``float(x)`` when it is a finite number, else None."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def check_args(n_boot: int, confidence: float) -> None:
    """Raise ValueError unless ``n_boot >= 1`` and ``0 < confidence < 1``."""
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


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


def weighted_quantiles(
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


def mean_draws(rng: np.random.Generator, values: FloatArray, n_boot: int) -> FloatArray:
    """Means of ``n_boot`` resamples (with replacement) of ``values``; shape ``(n_boot,)``."""
    idx = rng.integers(0, values.size, size=(n_boot, values.size))
    means: FloatArray = values[idx].mean(axis=1)
    return means


def interval(draws: FloatArray, confidence: float) -> tuple[float, float] | None:
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


def effect(
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
        eff.ci, eff.ci_of = interval(draws, confidence), "ratio"
    else:
        with np.errstate(invalid="ignore", over="ignore"):
            draws = np.where(both, var_draws - ref_draws, np.nan)
        eff.ci, eff.ci_of = interval(draws, confidence), "difference"
    if eff.ci is None:
        eff.ci_of = None
    return eff


def all_equal(a: FloatArray, b: FloatArray) -> bool:
    return bool(a.size and b.size and np.all(a == a[0]) and np.all(b == a[0]))


def run_effect(
    rng: np.random.Generator, rv: FloatArray, vv: FloatArray, n_boot: int, confidence: float
) -> Effect:
    """Mean over repeats per side and a bootstrap over repeats (None CI below the minimum)."""
    ref_point, var_point = float(rv.mean()), float(vv.mean())
    if rv.size < MIN_RUN_REPEATS or vv.size < MIN_RUN_REPEATS:
        identical = all_equal(rv, vv)
        if identical:
            var_point = ref_point
        eff = effect(ref_point, var_point, None, None, confidence)
        eff.identical = identical
        return eff
    return effect(
        ref_point,
        var_point,
        mean_draws(rng, rv, n_boot),
        mean_draws(rng, vv, n_boot),
        confidence,
    )
