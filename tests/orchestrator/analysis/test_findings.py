"""orchestrator.analysis.findings: diagnoses drawn from the comparisons."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pytest

from orchestrator.analysis.compare import ChangedVariable, RunData, VariantRef, compare_variant
from orchestrator.analysis.findings import findings
from tests.orchestrator.analysis.test_compare import BASE_TTFT, N_BOOT, req, run


def hit_rate_runs(variant: str, rate: float, e2e_scale: float) -> list[RunData]:
    return [
        run(
            variant,
            i,
            [req(t * e2e_scale, itl=[0.05 * e2e_scale] * 4) for t in BASE_TTFT],
            {"prefix_cache_hit_rate": rate + 0.01 * i},
        )
        for i in range(3)
    ]


def refs_for(variant: str, reference: str, changed: ChangedVariable) -> dict[str, VariantRef]:
    return {variant: VariantRef(variant=variant, reference=reference, changed=changed)}


APC = ChangedVariable(
    name="enable_prefix_caching",
    paths=["engine_args.enable_prefix_caching"],
    reference_value=False,
    variant_value=True,
)


@pytest.mark.parametrize(
    ("rate", "scale", "expected"), [(0.6, 1.0, 1), (0.6, 0.5, 0), (0.2, 1.0, 0)]
)
def test_finding_hit_rate_up_e2e_flat(rate: float, scale: float, expected: int) -> None:
    runs = {
        "baseline": hit_rate_runs("baseline", 0.05, 1.0),
        "apc-on": hit_rate_runs("apc-on", rate, scale),
    }
    comps = {"apc-on": compare_variant(runs["apc-on"], runs["baseline"], n_boot=N_BOOT)}
    got = [
        f
        for f in findings(comps, runs, refs_for("apc-on", "baseline", APC), n_boot=N_BOOT)
        if f.code == "hit_rate_up_e2e_flat"
    ]
    assert len(got) == expected
    if got:
        f = got[0]
        assert f.variant == "apc-on" and f.severity == "info"
        assert "decode or queueing dominates" in f.message
        assert f.evidence["prefix_cache_hit_rate_difference"] == pytest.approx(rate - 0.05)
        assert f.evidence["median_e2el_ms_verdict"] == "no clear difference"
        json.dumps(f.model_dump(), allow_nan=False)


def tp_runs(variant: str, throughputs: Sequence[float], devices: int) -> list[RunData]:
    return [
        run(variant, i, [], {"output_throughput": v}, devices=devices)
        for i, v in enumerate(throughputs)
    ]


TP = ChangedVariable(
    name="tensor_parallel_size",
    paths=["layout.tensor_parallel_size"],
    reference_value=1,
    variant_value=2,
)


@pytest.mark.parametrize(
    ("tp_values", "changed", "expected"),
    [
        ([150.0, 152.0, 148.0], TP, 1),  # 75 tok/s per device vs 100
        ([150.0], TP, 1),  # one repeat: point ratio 0.75 < 0.95
        ([250.0, 252.0, 248.0], TP, 0),  # 125 per device: TP paid off
        ([150.0, 152.0, 148.0], APC, 0),  # not a TP change
        (
            [150.0, 152.0, 148.0],
            TP.model_copy(update={"reference_value": 4, "variant_value": 2}),
            0,
        ),  # TP went down
    ],
)
def test_finding_tp_up_throughput_per_device_down(
    tp_values: list[float], changed: ChangedVariable, expected: int
) -> None:
    ref_values = [100.0, 101.0, 99.0] if len(tp_values) > 1 else [100.0]
    runs = {"baseline": tp_runs("baseline", ref_values, 1), "tp2": tp_runs("tp2", tp_values, 2)}
    comps = {"tp2": compare_variant(runs["tp2"], runs["baseline"], n_boot=N_BOOT)}
    got = findings(comps, runs, refs_for("tp2", "baseline", changed), n_boot=N_BOOT)
    got = [f for f in got if f.code == "tp_up_throughput_per_device_down"]
    assert len(got) == expected
    if got:
        ev = got[0].evidence
        assert got[0].severity == "warning" and "communication cost" in got[0].message
        assert ev["output_throughput_per_device_reference"] == pytest.approx(np.mean(ref_values))
        assert ev["ratio"] == pytest.approx(np.mean(tp_values) / 2 / np.mean(ref_values))
        assert (ev["tensor_parallel_size_reference"], ev["tensor_parallel_size_variant"]) == (1, 2)
        json.dumps(got[0].model_dump(), allow_nan=False)


def class_runs(variant: str, short_ttft_scale: float, with_long: bool) -> list[RunData]:
    out = []
    for i in range(3):
        reqs = [req(t * short_ttft_scale, request_class="short") for t in BASE_TTFT]
        if with_long:
            reqs += [req(2.0 + t, request_class="long") for t in BASE_TTFT[:20]]
        out.append(run(variant, i, reqs))
    return out


@pytest.mark.parametrize(
    ("mixed_scale", "short_only_present", "expected"),
    [(1.5, True, 1), (1.0, True, 0), (1.5, False, 0)],
)
def test_finding_long_requests_starve_short(
    mixed_scale: float, short_only_present: bool, expected: int
) -> None:
    runs = {"mixed": class_runs("mixed", mixed_scale, with_long=True)}
    refs: dict[str, VariantRef] = {}
    if short_only_present:
        runs["short-only"] = class_runs("short-only", 1.0, with_long=False)
        refs = refs_for(
            "short-only",
            "mixed",
            ChangedVariable(name="workload.request_classes", paths=["workload.request_classes"]),
        )
    got = [
        f for f in findings({}, runs, refs, n_boot=N_BOOT) if f.code == "long_requests_starve_short"
    ]
    assert len(got) == expected
    if got:
        f = got[0]
        assert f.variant == "mixed" and f.evidence["short_only_variant"] == "short-only"
        assert f.evidence["ratio"] == pytest.approx(1.5)
        assert f.evidence["ci"][0] > 1.0
        assert f.evidence["n_short_requests_mixed"] == 180
        assert "separate endpoint" in f.message


def test_a_wide_e2el_interval_is_not_flat() -> None:
    """Noisy E2EL (no clear difference, but a CI spanning 0.5x-2x) does not support
    "barely moved": no hit_rate_up_e2e_flat finding (a new-user trial saw [0.33, 1.80])."""
    noisy = [
        run(
            "apc-on",
            i,
            [
                req(t * s, itl=[0.05 * s] * 4)
                for t, s in zip(BASE_TTFT, [0.3, 2.2] * len(BASE_TTFT), strict=False)
            ],
            {"prefix_cache_hit_rate": 0.6},
        )
        for i in range(3)
    ]
    runs = {"baseline": hit_rate_runs("baseline", 0.05, 1.0), "apc-on": noisy}
    comps = {"apc-on": compare_variant(noisy, runs["baseline"], n_boot=N_BOOT)}
    e2el = next(c for c in comps["apc-on"] if c.metric == "median_e2el_ms")
    assert e2el.verdict == "no clear difference"
    assert e2el.ci_low is not None and e2el.ci_high is not None
    assert e2el.ci_low < 0.8 or e2el.ci_high > 1.25
    codes = [
        f.code for f in findings(comps, runs, refs_for("apc-on", "baseline", APC), n_boot=N_BOOT)
    ]
    assert "hit_rate_up_e2e_flat" not in codes
