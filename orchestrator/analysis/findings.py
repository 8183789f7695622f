"""Experiment findings: diagnoses drawn from variant-vs-reference comparisons
(:func:`orchestrator.analysis.compare.compare_variant`), each with the numbers behind it:
hit rate up but E2E latency flat, more tensor parallelism but less throughput per device,
long requests starving short ones.

Pure functions: no database, no Ray, no FastAPI; the bootstraps some findings run
themselves use the estimators of :mod:`orchestrator.analysis.compare`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field

from orchestrator.analysis.bootstrap import (
    Effect,
    FloatArray,
    check_args,
    finite_float,
    hierarchical_counts,
    run_effect,
)
from orchestrator.analysis.compare import (
    MetricComparison,
    RunData,
    VariantRef,
    measured_requests,
    request_effects,
    side_of,
    usable_runs,
)
from orchestrator.analysis.trust import na_text, warm_cache_reason, warm_cache_runs


class Finding(BaseModel):
    """A diagnosis drawn from comparisons; ``evidence`` holds the numbers behind it."""

    code: str
    severity: Literal["info", "warning"]
    variant: str
    message: str
    evidence: dict[str, Any] = Field(default_factory=dict)


def _by_metric(comparisons: Iterable[MetricComparison]) -> dict[str, MetricComparison]:
    return {c.metric: c for c in comparisons}


def _tp_values(ref: VariantRef | None) -> tuple[float, float] | None:
    """(reference, variant) tensor_parallel_size when the changed variable includes it."""
    if ref is None or ref.changed is None:
        return None
    ch = ref.changed
    tp_paths = [p for p in ch.paths if p.split(".")[-1] == "tensor_parallel_size"]
    if ch.name.split(".")[-1] == "tensor_parallel_size" and not tp_paths:
        tp_paths = [ch.name]
    if not tp_paths:
        return None
    path = tp_paths[0]

    def pick(value: Any) -> float | None:
        if isinstance(value, Mapping):
            for key in (path, path.split(".")[-1]):
                if key in value:
                    return finite_float(value[key])
            return None
        return finite_float(value)

    r, v = pick(ch.reference_value), pick(ch.variant_value)
    return None if r is None or v is None else (r, v)


def _per_device(runs: Sequence[RunData], name: str) -> FloatArray:
    vals = [finite_float(r.metrics.get(name)) for r in usable_runs(runs)]
    return np.asarray(
        [v / r.devices for v, r in zip(vals, usable_runs(runs), strict=True) if v is not None],
        dtype=np.float64,
    )


def _classes(runs: Sequence[RunData]) -> set[str | None]:
    return {q.get("request_class") for r in usable_runs(runs) for q in measured_requests(r)}


def _ci_list(eff: Effect) -> list[float] | None:
    return list(eff.ci) if eff.ci else None


def _hit_rate_rise(hit: MetricComparison | None) -> float | None:
    """How far the hit rate rose: the difference, or from prefix caching off (no hit
    rate, ``not applicable``) the variant's hit rate; None when it cannot be said or a
    flag withholds it."""
    if hit is None or not hit.trustworthy:
        return None
    if hit.difference is not None:
        return hit.difference
    if set(hit.not_applicable) == {"reference"} and hit.variant is not None:
        return hit.variant
    return None


def _hit_text(hit: MetricComparison, side: str) -> str:
    value = hit.reference if side == "reference" else hit.variant
    if side in hit.not_applicable or value is None:
        return na_text(hit.not_applicable.get(side, "unknown"))
    return f"{value:.2f}"


#: Equivalence margin for "E2EL did not move": the ratio's whole CI inside it.
FLAT_LOW, FLAT_HIGH = 0.8, 1.25


def findings(
    comparisons_by_variant: Mapping[str, Sequence[MetricComparison]],
    runs_by_variant: Mapping[str, Sequence[RunData]],
    refs: Mapping[str, VariantRef],
    *,
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> list[Finding]:
    """Diagnoses drawn from the comparisons, each with the numbers behind it.

    Args:
        comparisons_by_variant: variant -> :func:`compare_variant` output vs
            its reference (``refs[variant].reference``).
        runs_by_variant: variant -> its repeats (every variant, baseline too).
        refs: variant -> :class:`VariantRef`.
        n_boot, seed, confidence: as :func:`compare_variant`, for the
            bootstraps some findings run themselves.

    Codes:
        - ``warm_cache_contamination`` (warning, first): a run of the variant or of its
          reference measured on a warm prefix cache (its warm-cache check,
          :mod:`jobs.signals.cachecheck`, says ``contaminated``): every ratio of the comparison
          is marked not trustworthy (:func:`orchestrator.analysis.compare.compare_variant`)
          and the finding names the runs.
        - ``hit_rate_up_e2e_flat`` (info): prefix cache hit rate up by >= 0.2
          (absolute) but median E2EL flat: its ratio CI lies within
          [:data:`FLAT_LOW`, :data:`FLAT_HIGH`] (an equivalence margin of ±20 %;
          a wider interval is inconclusive, not flat), or, without a CI, the
          point ratio is within [0.9, 1.1].
        - ``tp_up_throughput_per_device_down`` (warning): the changed variable
          includes ``tensor_parallel_size``, it increased, and output
          throughput per reserved device fell (ratio CI entirely below 1, or
          point ratio < 0.95 when there is no CI; bootstrap over repeats).
        - ``long_requests_starve_short`` (warning): in a variant whose
          requests mix ``request_class`` "short" and "long", the short
          requests' median TTFT is >= 1.2x that of a variant that sent only
          short requests, with the ratio's CI above 1 (hierarchical bootstrap).
          The short-only set is the variant's reference when that is
          short-only, else a variant referencing it that is, else the first
          short-only variant.

    Returns:
        Findings in ``comparisons_by_variant`` order (then ``runs_by_variant``
        order for the request-class check); JSON-safe evidence.
    """
    check_args(n_boot, confidence)
    rng = np.random.Generator(np.random.PCG64(seed))
    return [
        *_warm_cache_findings(comparisons_by_variant, runs_by_variant, refs),
        *_hit_rate_findings(comparisons_by_variant, refs),
        *_tp_findings(comparisons_by_variant, runs_by_variant, refs, rng, n_boot, confidence),
        *_starve_findings(runs_by_variant, refs, rng, n_boot, confidence),
    ]


def _warm_cache_findings(
    comparisons_by_variant: Mapping[str, Sequence[MetricComparison]],
    runs_by_variant: Mapping[str, Sequence[RunData]],
    refs: Mapping[str, VariantRef],
) -> list[Finding]:
    """``warm_cache_contamination``: a variant or its reference measured on a warm cache."""
    out: list[Finding] = []
    for variant in comparisons_by_variant:
        ref_name = refs[variant].reference if variant in refs else None
        var_runs = runs_by_variant.get(variant, [])
        ref_runs = runs_by_variant.get(ref_name, []) if ref_name is not None else []
        reason = warm_cache_reason(var_runs, ref_runs)
        if reason is not None:
            out.append(
                Finding(
                    code="warm_cache_contamination",
                    severity="warning",
                    variant=variant,
                    message=f"the comparison with {ref_name!r} is not trustworthy: runs {reason}",
                    evidence={
                        "reference": ref_name,
                        "variant_runs": warm_cache_runs(var_runs),
                        "reference_runs": warm_cache_runs(ref_runs),
                    },
                )
            )
    return out


def _hit_rate_findings(
    comparisons_by_variant: Mapping[str, Sequence[MetricComparison]],
    refs: Mapping[str, VariantRef],
) -> list[Finding]:
    """``hit_rate_up_e2e_flat``: hit rate up by >= 0.2 but median E2EL flat."""
    out: list[Finding] = []
    for variant, comps in comparisons_by_variant.items():
        by = _by_metric(comps)
        hit, e2el = by.get("prefix_cache_hit_rate"), by.get("median_e2el_ms")
        rise = _hit_rate_rise(hit)
        if hit is not None and e2el is not None and rise is not None and rise >= 0.2:
            if e2el.ci_of == "ratio" and e2el.ci_low is not None and e2el.ci_high is not None:
                # "barely moved" needs evidence: the whole interval within +-20 %; a wide
                # interval means the runs cannot tell, which is no finding
                flat = e2el.ci_low >= FLAT_LOW and e2el.ci_high <= FLAT_HIGH
            else:
                flat = e2el.ratio is not None and 0.9 <= e2el.ratio <= 1.1
            if flat:
                out.append(
                    Finding(
                        code="hit_rate_up_e2e_flat",
                        severity="info",
                        variant=variant,
                        message=(
                            f"prefix cache hit rate rose from {_hit_text(hit, 'reference')} "
                            f"to {_hit_text(hit, 'variant')} but median E2EL barely moved: "
                            "decode or "
                            "queueing dominates E2E latency; prefill savings don't show "
                            "end to end"
                        ),
                        evidence={
                            "reference": refs[variant].reference if variant in refs else None,
                            "prefix_cache_hit_rate_reference": hit.reference,
                            "prefix_cache_hit_rate_variant": hit.variant,
                            "prefix_cache_hit_rate_difference": hit.difference,
                            "prefix_cache_hit_rate_not_applicable": hit.not_applicable or None,
                            "median_e2el_ms_reference": e2el.reference,
                            "median_e2el_ms_variant": e2el.variant,
                            "median_e2el_ms_ratio": e2el.ratio,
                            "median_e2el_ms_ci": [e2el.ci_low, e2el.ci_high],
                            "median_e2el_ms_ci_of": e2el.ci_of,
                            "median_e2el_ms_verdict": e2el.verdict,
                        },
                    )
                )
    return out


def _tp_findings(
    comparisons_by_variant: Mapping[str, Sequence[MetricComparison]],
    runs_by_variant: Mapping[str, Sequence[RunData]],
    refs: Mapping[str, VariantRef],
    rng: np.random.Generator,
    n_boot: int,
    confidence: float,
) -> list[Finding]:
    """``tp_up_throughput_per_device_down``: more tensor parallelism, less throughput per
    reserved device (bootstrap over repeats)."""
    out: list[Finding] = []
    for variant in comparisons_by_variant:
        ref = refs.get(variant)
        tp = _tp_values(ref)
        if ref is None or tp is None or not tp[1] > tp[0]:
            continue
        rv = _per_device(runs_by_variant.get(ref.reference, []), "output_throughput")
        vv = _per_device(runs_by_variant.get(variant, []), "output_throughput")
        if rv.size == 0 or vv.size == 0:
            continue
        eff = run_effect(rng, rv, vv, n_boot, confidence)
        if eff.ratio is None:
            continue
        if eff.ci is None:
            down = eff.ratio < 0.95
        else:
            down = eff.ci[1] < (1.0 if eff.ci_of == "ratio" else 0.0)
        if down:
            out.append(
                Finding(
                    code="tp_up_throughput_per_device_down",
                    severity="warning",
                    variant=variant,
                    message=(
                        f"tensor_parallel_size {tp[0]:g} -> {tp[1]:g} lowered output "
                        f"throughput per reserved device to {eff.ratio:.2f}x: communication "
                        "cost outweighs the extra devices"
                    ),
                    evidence={
                        "reference": ref.reference,
                        "tensor_parallel_size_reference": tp[0],
                        "tensor_parallel_size_variant": tp[1],
                        "output_throughput_per_device_reference": eff.reference,
                        "output_throughput_per_device_variant": eff.variant,
                        "ratio": eff.ratio,
                        "ci": _ci_list(eff),
                        "confidence": confidence,
                        "n_reference_repeats": int(rv.size),
                        "n_variant_repeats": int(vv.size),
                    },
                )
            )
    return out


def _starve_findings(
    runs_by_variant: Mapping[str, Sequence[RunData]],
    refs: Mapping[str, VariantRef],
    rng: np.random.Generator,
    n_boot: int,
    confidence: float,
) -> list[Finding]:
    """``long_requests_starve_short``: short requests' median TTFT beside long ones against
    a short-only variant (hierarchical bootstrap)."""
    out: list[Finding] = []
    short_only = [v for v, runs in runs_by_variant.items() if _classes(runs) == {"short"}]
    for variant, runs in runs_by_variant.items():
        if not {"short", "long"} <= _classes(runs) or not short_only:
            continue
        ref = refs.get(variant)
        candidates = [ref.reference] if ref is not None else []
        candidates += [w for w, r in refs.items() if r.reference == variant]
        chosen = next((c for c in candidates if c in short_only), short_only[0])
        mixed = side_of(runs, keep={"request_class": "short"})
        alone = side_of(runs_by_variant[chosen])
        ref_counts = hierarchical_counts(rng, alone.sizes, n_boot)
        var_counts = hierarchical_counts(rng, mixed.sizes, n_boot)
        res = request_effects(alone, mixed, "ttft_s", [0.5], ref_counts, var_counts, confidence)
        if res is None:
            continue
        (eff,), n_alone, n_mixed = res
        starved = (
            eff.ratio is not None
            and eff.ratio >= 1.2
            and eff.ci is not None
            and eff.ci_of == "ratio"
            and eff.ci[0] > 1.0
        )
        if starved:
            out.append(
                Finding(
                    code="long_requests_starve_short",
                    severity="warning",
                    variant=variant,
                    message=(
                        f"short requests' median TTFT is {eff.ratio:.2f}x what it is when "
                        f"only short requests are sent ({chosen!r}): long requests starve "
                        "short ones; serve them from a separate endpoint or cap long "
                        "inputs (e.g. a lower max_model_len or max_num_batched_tokens)"
                    ),
                    evidence={
                        "short_only_variant": chosen,
                        "median_ttft_ms_short_mixed": eff.variant,
                        "median_ttft_ms_short_only": eff.reference,
                        "ratio": eff.ratio,
                        "ci": _ci_list(eff),
                        "confidence": confidence,
                        "n_short_requests_mixed": n_mixed,
                        "n_requests_short_only": n_alone,
                    },
                )
            )
    return out
