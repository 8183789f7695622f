"""orchestrator.analysis.compare: effect sizes, bootstrap CIs, verdicts (findings:
test_findings.py; tables: test_export.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.analysis.bootstrap import weighted_quantiles
from orchestrator.analysis.compare import (
    METRICS,
    MetricComparison,
    RunData,
    compare_variant,
)

N_BOOT = 400


def req(
    ttft: float,
    *,
    itl: Sequence[float] = (0.01, 0.01, 0.01),
    success: bool = True,
    warmup: bool = False,
    request_class: str | None = None,
) -> dict[str, Any]:
    """A request record: E2EL = TTFT + sum(ITL), TPOT per vllm bench serve."""
    e2el = ttft + sum(itl)
    out_tokens = len(itl) + 1
    r: dict[str, Any] = {
        "ttft_s": ttft,
        "itl_s": list(itl),
        "tpot_s": (e2el - ttft) / (out_tokens - 1) if out_tokens > 1 else None,
        "e2el_s": e2el,
        "output_tokens": out_tokens,
        "prompt_tokens": 100,
        "success": success,
        "warmup": warmup,
    }
    if request_class is not None:
        r["request_class"] = request_class
    return r


def run(
    variant: str,
    repeat: int,
    requests: list[dict[str, Any]],
    metrics: dict[str, float] | None = None,
    *,
    status: str = "succeeded",
    devices: int = 1,
) -> RunData:
    return RunData(
        run_id=f"{variant}-{repeat}",
        variant=variant,
        repeat_index=repeat,
        status=status,
        metrics=metrics or {},
        requests=requests,
        devices=devices,
    )


def ttft_runs(variant: str, ttfts: Sequence[float], repeats: int = 3, **kw: Any) -> list[RunData]:
    return [run(variant, i, [req(t, **kw) for t in ttfts]) for i in range(repeats)]


def by_name(comps: list[MetricComparison]) -> dict[str, MetricComparison]:
    return {c.metric: c for c in comps}


def json_safe(comps: list[MetricComparison]) -> None:
    json.dumps([c.model_dump() for c in comps], allow_nan=False)


BASE_TTFT = list(np.linspace(0.1, 0.2, 60))


# ----------------------------------------------------------------- compare_variant


def test_half_ttft_is_better_with_exact_ratio() -> None:
    ref = ttft_runs("baseline", BASE_TTFT)
    var = ttft_runs("apc-on", [t / 2 for t in BASE_TTFT])
    c = by_name(compare_variant(var, ref, n_boot=N_BOOT))["median_ttft_ms"]
    assert c.unit == "ms" and c.level == "request" and c.direction == "lower_is_better"
    assert c.reference == pytest.approx(np.median(BASE_TTFT) * 1000)
    assert c.ratio == pytest.approx(0.5)
    assert c.difference == pytest.approx(-np.median(BASE_TTFT) * 500)
    assert c.ci_of == "ratio"
    assert c.ci_low is not None and c.ci_high is not None
    assert c.ci_low <= 0.5 <= c.ci_high < 1.0
    assert c.verdict == "better"
    assert (c.n_reference_repeats, c.n_variant_repeats) == (3, 3)
    assert (c.n_reference_requests, c.n_variant_requests, c.n_requests) == (180, 180, 360)


def test_identical_distributions_no_clear_difference() -> None:
    ref = ttft_runs("baseline", BASE_TTFT)
    var = ttft_runs("v", BASE_TTFT)
    comps = compare_variant(var, ref, n_boot=N_BOOT)
    request_level = [c for c in comps if c.level == "request"]
    assert {c.metric for c in request_level} == {m.name for m in METRICS if m.level == "request"}
    for c in request_level:
        assert c.ratio == pytest.approx(1.0)
        assert c.verdict == "no clear difference", c


def test_metric_order_and_missing_metrics_are_omitted() -> None:
    ref = [run("b", i, [req(0.1)] * 5, {"output_throughput": 10.0}) for i in range(2)]
    var = [
        run("v", i, [req(0.1)] * 5, {"output_throughput": 10.0, "request_goodput": 1.0})
        for i in range(2)
    ]
    names = [c.metric for c in compare_variant(var, ref, n_boot=50)]
    assert "request_goodput" not in names and "prefix_cache_hit_rate" not in names
    order = [m.name for m in METRICS]
    assert names == sorted(names, key=order.index)
    assert names[-1] == "output_throughput"


def test_throughput_is_higher_is_better() -> None:
    ref = [run("b", i, [], {"output_throughput": v}) for i, v in enumerate([100.0, 102.0, 98.0])]
    up = [run("v", i, [], {"output_throughput": v}) for i, v in enumerate([150.0, 153.0, 147.0])]
    c = by_name(compare_variant(up, ref, n_boot=N_BOOT))["output_throughput"]
    assert c.direction == "higher_is_better" and c.level == "run" and c.unit == "tok/s"
    assert c.reference == pytest.approx(100.0) and c.variant == pytest.approx(150.0)
    assert c.ratio == pytest.approx(1.5)
    assert c.ci_low is not None and c.ci_low > 1.0
    assert c.verdict == "better"
    assert c.n_requests is None
    down = by_name(compare_variant(ref, up, n_boot=N_BOOT))["output_throughput"]
    assert down.verdict == "worse"


def test_neutral_metric_reports_higher_or_lower() -> None:
    ref = [run("b", i, [], {"kv_cache_usage_peak": v}) for i, v in enumerate([0.2, 0.21, 0.19])]
    var = [run("v", i, [], {"kv_cache_usage_peak": v}) for i, v in enumerate([0.6, 0.61, 0.59])]
    assert by_name(compare_variant(var, ref))["kv_cache_usage_peak"].verdict == "higher"
    assert by_name(compare_variant(ref, var))["kv_cache_usage_peak"].verdict == "lower"


def test_zero_reference_uses_difference_ci() -> None:
    ref = [run("b", i, [], {"prefix_cache_hit_rate": 0.0}) for i in range(3)]
    var = [run("v", i, [], {"prefix_cache_hit_rate": v}) for i, v in enumerate([0.7, 0.72, 0.71])]
    c = by_name(compare_variant(var, ref))["prefix_cache_hit_rate"]
    assert c.ratio is None and c.ci_of == "difference"
    assert c.difference == pytest.approx(0.71)
    assert c.ci_low is not None and c.ci_low > 0
    assert c.verdict == "better"


def test_one_repeat_per_side_run_level_insufficient() -> None:
    ref = [run("b", 0, [req(t) for t in BASE_TTFT], {"output_throughput": 100.0})]
    var = [run("v", 0, [req(t / 2) for t in BASE_TTFT], {"output_throughput": 120.0})]
    comps = by_name(compare_variant(var, ref, n_boot=N_BOOT))
    tp = comps["output_throughput"]
    assert tp.verdict == "insufficient data"
    assert tp.ci_low is None and tp.ci_high is None and tp.ci_of is None
    assert tp.ratio == pytest.approx(1.2)
    # request-level still has a (request-only) CI
    assert comps["median_ttft_ms"].verdict == "better"
    same = [run("v", 0, [], {"output_throughput": 100.0})]
    assert by_name(compare_variant(same, ref))["output_throughput"].verdict == (
        "no clear difference"
    )


def test_warmup_failed_and_unsuccessful_runs_are_excluded() -> None:
    ref = ttft_runs("b", BASE_TTFT)
    noisy = [
        run(
            "b",
            i,
            [req(t) for t in BASE_TTFT]
            + [
                req(50.0, warmup=True),
                req(60.0, success=False),
                {"success": True, "warmup": False},
            ],
        )
        for i in range(3)
    ]
    noisy.append(run("b", 9, [req(99.0)] * 10, status="failed"))
    a = by_name(compare_variant(ref, ref, n_boot=50))["p99_ttft_ms"]
    b = by_name(compare_variant(noisy, noisy, n_boot=50))["p99_ttft_ms"]
    assert a.reference == pytest.approx(b.reference)
    assert b.n_reference_repeats == 3 and b.n_reference_requests == 180


def test_itl_pools_gaps() -> None:
    gaps = [[0.01, 0.02], [0.03, 0.05, 0.07], [0.04]]
    ref = [run("b", 0, [req(0.1, itl=g) for g in gaps])]
    c = by_name(compare_variant(ref, ref, n_boot=50))["p90_itl_ms"]
    pooled = [x for g in gaps for x in g]
    assert c.reference == pytest.approx(np.percentile(pooled, 90) * 1000)
    assert c.n_reference_requests == len(pooled)


def test_hierarchical_bootstrap_keeps_run_to_run_variance() -> None:
    """Repeats that differ a lot: a 15 % shift is not distinguishable with 3 repeats."""
    base = np.linspace(0.1, 0.2, 300)
    ref = [run("b", i, [req(t * s) for t in base]) for i, s in enumerate([1.0, 1.3, 1.6])]
    var = [run("v", i, [req(t * s * 1.15) for t in base]) for i, s in enumerate([1.0, 1.3, 1.6])]
    c = by_name(compare_variant(var, ref, n_boot=N_BOOT))["median_ttft_ms"]
    assert c.ratio == pytest.approx(1.15)
    assert c.verdict == "no clear difference"
    # the same shift within one repeat (only request noise) is detected
    one = by_name(compare_variant(var[:1], ref[:1], n_boot=N_BOOT))["median_ttft_ms"]
    assert one.verdict == "worse"


def test_deterministic_under_seed() -> None:
    ref = ttft_runs("b", BASE_TTFT)
    var = ttft_runs("v", [t * 1.02 for t in BASE_TTFT])
    a = [c.model_dump() for c in compare_variant(var, ref, n_boot=N_BOOT, seed=3)]
    b = [c.model_dump() for c in compare_variant(var, ref, n_boot=N_BOOT, seed=3)]
    c = [c.model_dump() for c in compare_variant(var, ref, n_boot=N_BOOT, seed=4)]
    assert a == b
    assert a != c


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        compare_variant([], [], n_boot=0)
    with pytest.raises(ValueError):
        compare_variant([], [], confidence=1.0)
    assert compare_variant([], []) == []


def test_weighted_quantiles_match_expanded_percentile() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        n_owner, g = int(rng.integers(1, 20)), int(rng.integers(1, 150))
        values = np.round(rng.normal(size=g), int(rng.integers(0, 3)))
        owner = rng.integers(0, n_owner, size=g)
        counts = rng.integers(0, 3, size=(10, n_owner)).astype(float)
        qs = [0.0, 0.5, 0.9, 0.99, 1.0]
        got = weighted_quantiles(values, owner, counts, qs)
        for b in range(10):
            expanded = np.repeat(values, counts[b, owner].astype(int))
            if expanded.size == 0:
                assert np.isnan(got[b]).all()
            else:
                np.testing.assert_allclose(got[b], np.percentile(expanded, [q * 100 for q in qs]))


# ----------------------------------------------------------------- properties

latency = st.floats(min_value=1e-3, max_value=10.0, allow_nan=False)
repeat_lists = st.lists(st.lists(latency, min_size=1, max_size=12), min_size=1, max_size=3)


def runs_from(variant: str, repeats: list[list[float]], scale: float = 1.0) -> list[RunData]:
    return [
        run(
            variant,
            i,
            [req(t * scale, itl=[t * scale / 10, t * scale / 7]) for t in ttfts],
            {"output_throughput": sum(ttfts) / scale, "kv_cache_usage_peak": ttfts[0]},
        )
        for i, ttfts in enumerate(repeats)
    ]


@settings(max_examples=40, deadline=None)
@given(ref=repeat_lists, var=repeat_lists, seed=st.integers(0, 2**32 - 1))
def test_property_outputs_json_safe_and_ordered(
    ref: list[list[float]], var: list[list[float]], seed: int
) -> None:
    comps = compare_variant(runs_from("v", var), runs_from("b", ref), n_boot=100, seed=seed)
    json_safe(comps)
    for c in comps:
        if c.ci_low is not None and c.ci_high is not None:
            assert c.ci_low <= c.ci_high
            assert c.ci_of in ("ratio", "difference")
        else:
            assert c.ci_of is None
            assert c.verdict in ("insufficient data", "no clear difference")
        if c.ci_of == "ratio":
            assert c.ratio is not None and c.ci_low is not None and c.ci_high is not None
            # the point ratio lies in the range the bootstrap can produce
            assert c.ci_low > 0


@settings(max_examples=30, deadline=None)
@given(
    ref=repeat_lists,
    k=st.floats(min_value=1.01, max_value=20.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_slower_variant_never_better(ref: list[list[float]], k: float, seed: int) -> None:
    comps = compare_variant(
        runs_from("v", ref, scale=k), runs_from("b", ref), n_boot=200, seed=seed
    )
    for c in comps:
        if c.direction == "lower_is_better" and c.level == "request":
            assert c.verdict != "better", c
            assert c.ratio == pytest.approx(k, rel=1e-9)
        if c.metric == "output_throughput":
            assert c.verdict != "better", c
