"""orchestrator.analysis.compare: effect sizes, bootstrap CIs, verdicts, findings, tables."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.analysis.compare import (
    METRICS,
    ChangedVariable,
    MetricComparison,
    RunData,
    VariantRef,
    _weighted_quantiles,
    compare_variant,
    findings,
    parquet_safe,
    runs_table,
    to_csv_bytes,
    to_parquet_bytes,
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
        got = _weighted_quantiles(values, owner, counts, qs)
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


# ----------------------------------------------------------------- findings


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


# ----------------------------------------------------------------- tables


def run_rows() -> list[dict[str, Any]]:
    t0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    common = {
        "experiment_id": "e1",
        "model_id": "small",
        "model_digest": "sha256:abc",
        "max_model_len": 2048,
        "request_list_hash": "h1",
        "vllm_version": "0.32.0",
        "finished_at": None,
    }
    return [
        {
            **common,
            "id": "r1",
            "variant": "baseline",
            "repeat_index": 0,
            "sequence": 0,
            "status": "succeeded",
            "started_at": t0,
            "layout": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1},
            "workload": {"kind": "shared_prefix", "num_requests": 16, "extra": {"a": 1}},
            "engine_args": {"enable_prefix_caching": False, "max_num_seqs": None},
            "metrics": {"median_ttft_ms": 12.5, "output_throughput": 100.0},
        },
        {
            **common,
            "id": "r2",
            "variant": "apc-on",
            "repeat_index": 0,
            "sequence": 1,
            "status": "failed",
            "started_at": t0,
            "layout": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1},
            "workload": {"kind": "shared_prefix", "num_requests": 16, "extra": {"a": 2}},
            "engine_args": {"enable_prefix_caching": "auto", "max_num_seqs": 8, "tags": [1, 2]},
            "metrics": {},
        },
        {
            **common,
            "id": "r3",
            "variant": "apc-on",
            "repeat_index": 1,
            "sequence": 2,
            "status": "succeeded",
            "started_at": t0,
            "layout": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1},
            "workload": {"kind": "shared_prefix", "num_requests": 16},
            "engine_args": {"enable_prefix_caching": None, "max_num_seqs": 8.5},
            "metrics": {"median_ttft_ms": 7.5},
        },
    ]


def test_runs_table_columns() -> None:
    df = runs_table(run_rows())
    cols = list(df.columns)
    assert cols[:4] == ["id", "experiment_id", "variant", "repeat_index"]
    for c in (
        "layout.tensor_parallel_size",
        "workload.extra.a",
        "engine_args.enable_prefix_caching",
        "engine_args.tags",
        "metrics.median_ttft_ms",
    ):
        assert c in cols
    assert cols.index("layout.tensor_parallel_size") < cols.index("workload.kind")
    assert cols.index("engine_args.max_num_seqs") < cols.index("metrics.median_ttft_ms")
    assert df["layout.tensor_parallel_size"].tolist() == [1, 2, 2]
    assert df.loc[1, "engine_args.tags"] == "[1, 2]"
    assert pd.isna(df.loc[1, "metrics.median_ttft_ms"])
    assert runs_table([]).empty


def test_csv_round_trip() -> None:
    df = runs_table(run_rows())
    back = pd.read_csv(io.BytesIO(to_csv_bytes(df)))
    assert list(back.columns) == list(df.columns)
    assert back["id"].tolist() == ["r1", "r2", "r3"]
    assert back["layout.tensor_parallel_size"].tolist() == [1, 2, 2]
    np.testing.assert_allclose(back["metrics.median_ttft_ms"], [12.5, np.nan, 7.5])
    assert back["engine_args.enable_prefix_caching"].tolist()[:2] == ["False", "auto"]


def test_parquet_round_trip_with_mixed_types() -> None:
    df = runs_table(run_rows())
    back = pd.read_parquet(io.BytesIO(to_parquet_bytes(df)), engine="pyarrow")
    assert list(back.columns) == list(df.columns)
    safe = parquet_safe(df)
    assert safe["engine_args.enable_prefix_caching"].tolist() == ["false", "auto", None]
    apc = back["engine_args.enable_prefix_caching"].tolist()
    assert apc[:2] == ["false", "auto"] and pd.isna(apc[2])
    assert back["engine_args.max_num_seqs"].tolist()[1:] == [8.0, 8.5]
    assert back["layout.tensor_parallel_size"].tolist() == [1, 2, 2]
    np.testing.assert_allclose(back["metrics.median_ttft_ms"], [12.5, np.nan, 7.5])
    assert back["started_at"].tolist() == df["started_at"].tolist()
    pd.testing.assert_frame_equal(
        back.astype(str), safe.astype(str), check_dtype=False, check_column_type=False
    )


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
