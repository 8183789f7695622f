"""Spec expansion: one variable per variant, linked factors, invariants, ladder, interleaving."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from orchestrator.experiments.capacity_spec import search_time_bound
from orchestrator.experiments.run_layout import execution_order
from orchestrator.experiments.spec import (
    ExperimentSpec,
    RunConfig,
    config_diff,
    expand,
)


def spec(**kw: Any) -> ExperimentSpec:
    doc: dict[str, Any] = {
        "name": "t",
        "model": "tiny",
        "baseline": {"engine_args": {"enable_prefix_caching": False}},
        "variants": [{"name": "apc", "changes": {"engine_args.enable_prefix_caching": True}}],
    }
    doc.update(kw)
    return ExperimentSpec.model_validate(doc)


def test_expands_baseline_and_one_variant() -> None:
    variants, errors = expand(spec())
    assert errors == []
    assert [v.name for v in variants] == ["baseline", "apc"]
    assert variants[1].reference == "baseline"
    assert variants[1].variable == "engine_args.enable_prefix_caching"
    assert variants[1].config.engine_args == {"enable_prefix_caching": True}
    assert variants[1].config.workload == variants[0].config.workload


def test_variant_changing_two_variables_is_refused_naming_both_with_values() -> None:
    s = spec(
        variants=[
            {
                "name": "two",
                "changes": {"engine_args.enable_prefix_caching": True, "workload.concurrency": 4},
            }
        ]
    )
    _, errors = expand(s)
    assert [e["type"] for e in errors] == ["more_than_one_variable"]
    msg = errors[0]["msg"]
    assert "engine_args.enable_prefix_caching: False -> True" in msg
    assert "workload.concurrency: 1 -> 4" in msg


def test_level_equal_to_the_reference_is_refused() -> None:
    s = spec(
        variants=[],
        factors=[
            {"name": "apc", "paths": ["engine_args.enable_prefix_caching"], "levels": [False]}
        ],
    )
    _, errors = expand(s)
    assert [e["type"] for e in errors] == ["no_change"]
    assert errors[0]["loc"][:3] == ["body", "factors", 0]


def test_factor_levels_expand_against_the_baseline() -> None:
    s = spec(
        variants=[],
        factors=[{"name": "conc", "paths": ["workload.concurrency"], "levels": [2, 4]}],
    )
    variants, errors = expand(s)
    assert errors == []
    assert [v.name for v in variants] == ["baseline", "conc=2", "conc=4"]
    assert all(v.reference == "baseline" for v in variants[1:])
    assert [v.config.workload.concurrency for v in variants] == [1, 2, 4]


def test_linked_factor_moves_paths_together_and_checks_invariant() -> None:
    s = spec(
        baseline={
            "layout": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
        },
        variants=[],
        factors=[
            {
                "name": "parallel",
                "paths": ["layout.tensor_parallel_size", "layout.pipeline_parallel_size"],
                "levels": [
                    [4, 1],
                    {"layout.tensor_parallel_size": 1, "layout.pipeline_parallel_size": 4},
                    [2, 4],
                ],
                "invariant": "constant_product",
            }
        ],
    )
    variants, errors = expand(s)
    assert [v.name for v in variants] == ["baseline", "parallel=4,1", "parallel=1,4"]
    assert variants[1].variable == "parallel"
    assert variants[1].variable_paths == [
        "layout.pipeline_parallel_size",
        "layout.tensor_parallel_size",
    ]
    assert [e["type"] for e in errors] == ["invariant_broken"]
    assert "product" in errors[0]["msg"] and "4" in errors[0]["msg"] and "8" in errors[0]["msg"]


def test_explicit_variant_touching_a_linked_factors_paths_is_one_variable() -> None:
    s = spec(
        variants=[
            {
                "name": "ctx",
                "changes": {
                    "engine_args.max_model_len": 4096,
                    "engine_args.max_num_batched_tokens": 4096,
                },
            }
        ],
        factors=[
            {
                "name": "context",
                "paths": ["engine_args.max_model_len", "engine_args.max_num_batched_tokens"],
                "levels": [[2048, 2048]],
                "invariant": "equal_values",
            }
        ],
    )
    variants, errors = expand(s)
    assert errors == []
    assert [v.variable for v in variants[1:]] == ["context", "context"]


def test_equal_values_invariant() -> None:
    s = spec(
        variants=[],
        factors=[
            {
                "name": "context",
                "paths": ["engine_args.max_model_len", "engine_args.max_num_batched_tokens"],
                "levels": [[2048, 4096]],
                "invariant": "equal_values",
            }
        ],
    )
    _, errors = expand(s)
    assert [e["type"] for e in errors] == ["invariant_broken"]


def test_variant_reference_chain_and_unknown_reference() -> None:
    s = spec(
        variants=[
            {"name": "apc", "changes": {"engine_args.enable_prefix_caching": True}},
            {"name": "apc-c4", "changes": {"workload.concurrency": 4}, "reference": "apc"},
            {"name": "orphan", "changes": {"workload.concurrency": 2}, "reference": "nope"},
        ]
    )
    variants, errors = expand(s)
    by = {v.name: v for v in variants}
    assert by["apc-c4"].reference == "apc"
    assert by["apc-c4"].config.engine_args["enable_prefix_caching"] is True
    assert [e["type"] for e in errors] == ["unknown_reference"]


def test_ladder_preset_builds_the_chain() -> None:
    s = spec(variants=[], preset="ladder", baseline={"engine_args": {}})
    variants, errors = expand(s)
    assert errors == []
    assert [(v.name, v.reference) for v in variants] == [
        ("1-baseline", None),
        ("2-apc-on", "1-baseline"),
        ("3-tp2", "2-apc-on"),
        ("4-long-only", "3-tp2"),
        ("4-mixed", "3-tp2"),
    ]
    base, apc, tp, long_only, mixed = variants
    assert base.config.workload.long_fraction == 0.0
    assert long_only.config.workload.long_fraction == 1.0
    assert mixed.config.workload.long_fraction == 0.5
    assert mixed.variable == "workload.long_fraction"
    assert mixed.config.layout == tp.config.layout
    assert base.config.engine_args["enable_prefix_caching"] is False
    assert base.config.layout.reserved == tp.config.layout.reserved == 2
    assert tp.config.layout.tensor_parallel_size == 2
    assert tp.config.engine_args["enable_prefix_caching"] is True
    assert tp.variable == "layout.tensor_parallel_size"


def test_schema_errors_name_every_field() -> None:
    with pytest.raises(ValidationError) as exc:
        ExperimentSpec.model_validate(
            {
                "name": "",
                "model": "tiny",
                "baseline": {"layout": {"tensor_parallel_size": 0}, "bogus": 1},
                "variants": [{"name": "x", "changes": {"nope.thing": 1}}],
                "factors": [
                    {
                        "name": "f",
                        "paths": ["workload.seed"],
                        "levels": [],
                        "invariant": "equal_values",
                    }
                ],
            }
        )
    locs = {tuple(e["loc"]) for e in exc.value.errors()}
    assert ("name",) in locs
    assert ("baseline", "layout", "tensor_parallel_size") in locs
    assert ("baseline", "bogus") in locs
    assert ("variants", 0, "changes") in locs
    assert any(loc[:2] == ("factors", 0) for loc in locs)


def test_devices_must_hold_the_layout() -> None:
    with pytest.raises(ValidationError):
        RunConfig.model_validate({"layout": {"tensor_parallel_size": 2, "devices": 3}})


def test_execution_order_interleaves_and_groups_server_sharing_variants() -> None:
    variants, _ = expand(
        spec(
            variants=[
                {"name": "apc", "changes": {"engine_args.enable_prefix_caching": True}},
                {"name": "c4", "changes": {"workload.concurrency": 4}},
            ]
        )
    )
    order = execution_order(variants, 2)
    assert order == [
        ("baseline", 0),
        ("apc", 0),
        ("c4", 0),
        ("baseline", 1),
        ("apc", 1),
        ("c4", 1),
    ]
    keys = {"baseline": "k1", "apc": "k2", "c4": "k1"}
    grouped = execution_order(variants, 2, keys)
    assert [n for n, _ in grouped[:3]] == ["baseline", "c4", "apc"]


# -- properties -------------------------------------------------------------------------

PATHS = {
    "engine_args.enable_prefix_caching": st.booleans(),
    "engine_args.max_num_seqs": st.integers(1, 512),
    "engine_args.max_model_len": st.sampled_from([1024, 2048, 4096]),
    "workload.concurrency": st.integers(1, 64),
    "workload.num_requests": st.integers(1, 500),
    "workload.prefix_tokens": st.integers(0, 4096),
    "layout.tensor_parallel_size": st.sampled_from([1, 2, 4]),
}


@st.composite
def change_sets(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(sorted(PATHS)), min_size=1, max_size=4, unique=True))
    return {k: draw(PATHS[k]) for k in keys}


@settings(max_examples=150, deadline=None)
@given(st.lists(change_sets(), min_size=1, max_size=5))
def test_no_accepted_variant_differs_from_its_reference_in_more_than_one_variable(
    changes: list[dict[str, Any]],
) -> None:
    s = ExperimentSpec.model_validate(
        {
            "name": "prop",
            "model": "tiny",
            "baseline": {"engine_args": {"enable_prefix_caching": False, "max_num_seqs": 8}},
            "variants": [{"name": f"v{i}", "changes": c} for i, c in enumerate(changes)],
        }
    )
    variants, errors = expand(s)
    by = {v.name: v for v in variants}
    refused = {e["loc"][2] for e in errors}
    for i, c in enumerate(changes):
        ref = by["baseline"].config
        name = f"v{i}"
        if name in by:
            diff = config_diff(ref, by[name].config)
            assert len(diff) == 1, diff
        else:
            assert i in refused
            # refused for a reason that is true of the change set
            from orchestrator.experiments.spec import apply_changes

            diff = config_diff(ref, apply_changes(ref, c))
            assert len(diff) != 1


@settings(max_examples=100, deadline=None)
@given(change_sets())
def test_every_multi_variable_change_is_refused(c: dict[str, Any]) -> None:
    s = ExperimentSpec.model_validate(
        {
            "name": "prop",
            "model": "tiny",
            "baseline": {"engine_args": {"enable_prefix_caching": False, "max_num_seqs": 8}},
            "variants": [{"name": "v", "changes": c}],
        }
    )
    from orchestrator.experiments.spec import apply_changes

    n_changed = len(config_diff(s.baseline, apply_changes(s.baseline, c)))
    _, errors = expand(s)
    if n_changed > 1:
        assert [e["type"] for e in errors] == ["more_than_one_variable"]
    elif n_changed == 0:
        assert [e["type"] for e in errors] == ["no_change"]
    else:
        assert errors == []


# --------------------------------------------------------------------------- capacity

CAPACITY = {"slos": {"ttft_ms": {"p50": 500}}, "min": 0.5, "max": 8}
OPEN_LOOP = {"arrival": "poisson", "request_rate": 1.0, "concurrency": 64}


def capacity_spec(capacity: dict[str, Any] | None = None, **kw: Any) -> ExperimentSpec:
    doc: dict[str, Any] = {
        "baseline": {"engine_args": {"enable_prefix_caching": False}, "workload": OPEN_LOOP},
        "capacity": capacity or CAPACITY,
    }
    doc.update(kw)
    return spec(**doc)


def test_capacity_is_a_setting_of_every_run_not_a_variable() -> None:
    s = capacity_spec()
    assert s.capacity is not None and s.capacity.variable == "request_rate"
    variants, errors = expand(s)
    assert errors == []
    assert [v.name for v in variants] == ["baseline", "apc"]
    with pytest.raises(ValidationError, match="measurement setting of the whole experiment"):
        capacity_spec(variants=[{"name": "x", "changes": {"capacity.max": 16}}])
    with pytest.raises(ValidationError, match="measurement setting of the whole experiment"):
        capacity_spec(factors=[{"name": "f", "paths": ["capacity.min"], "levels": [1, 2]}])


def test_capacity_rules_are_field_errors() -> None:
    for bad, needle in [
        ({**CAPACITY, "min": 8, "max": 8}, "capacity.min (8) must be below capacity.max (8)"),
        ({**CAPACITY, "variable": "concurrency", "min": 1, "max": 8.5}, "whole number"),
        ({**CAPACITY, "max": 200_000}, "at most 100000 requests/s"),
        (
            {**CAPACITY, "slos": {"ttft_ms": {}, "tpot_ms": {"p50": 50}}, "goodput": 0.9},
            "give at least one percentile",
        ),
    ]:
        with pytest.raises(ValidationError) as info:
            capacity_spec(bad)
        (err,) = info.value.errors()
        assert err["loc"] == ("capacity",) and needle in err["msg"], err


def test_capacity_variable_needs_a_matching_arrival() -> None:
    closed = {"engine_args": {"enable_prefix_caching": False}}
    _, errors = expand(capacity_spec(baseline=closed))
    assert [(e["loc"], e["type"]) for e in errors] == [
        (["body", "baseline", "workload", "arrival"], "capacity_arrival")
    ]
    assert "needs workload arrival 'constant' or 'poisson', not 'closed'" in errors[0]["msg"]
    by_concurrency = {**CAPACITY, "variable": "concurrency", "min": 1, "max": 16}
    assert expand(capacity_spec(by_concurrency, baseline=closed))[1] == []
    # a variant that moves the workload off the search's arrival is named where it does
    s = capacity_spec(
        by_concurrency,
        baseline=closed,
        variants=[{"name": "open", "changes": {"workload.arrival": "constant"}}],
    )
    _, errors = expand(s)
    assert all(e["loc"][:3] == ["body", "variants", 0] for e in errors), errors


def test_a_variant_may_not_change_what_the_search_drives() -> None:
    s = capacity_spec(variants=[{"name": "rate", "changes": {"workload.request_rate": 4.0}}])
    _, errors = expand(s)
    assert [e["type"] for e in errors] == ["capacity_driven"]
    assert errors[0]["loc"] == ["body", "variants", 0, "changes", "workload.request_rate"]
    per_step = {**CAPACITY, "requests_per_step": 20}
    s = capacity_spec(
        per_step, factors=[{"name": "n", "paths": ["workload.num_requests"], "levels": [32]}]
    )
    _, errors = expand(s)
    assert [e["type"] for e in errors] == ["capacity_driven"]
    assert "requests_per_step (20) sets each step's request count" in errors[0]["msg"]
    # other workload changes (concurrency cap of an open loop) are fine
    s = capacity_spec(variants=[{"name": "cap", "changes": {"workload.concurrency": 8}}])
    assert expand(s)[1] == []


def test_ladder_measures_capacity_at_every_level() -> None:
    s = ExperimentSpec.model_validate(
        {
            "name": "ladder",
            "model": "tiny",
            "preset": "ladder",
            "baseline": {"workload": OPEN_LOOP},
            "capacity": CAPACITY,
        }
    )
    variants, errors = expand(s)
    assert errors == []
    assert len(variants) == 5
    assert all(v.config.workload.arrival == "poisson" for v in variants)


def test_steps_too_small_for_an_objective_are_refused() -> None:
    # a p99 at 95 % needs 368 measured requests a step to ever pass: at 0.5 req/s a step
    # of at most max_step_s (300 s) holds 120 after its warm-up
    p99 = {"slos": {"ttft_ms": {"p99": 500}}, "min": 0.5, "max": 8}
    _, errors = expand(capacity_spec(p99))
    assert [(e["loc"], e["type"]) for e in errors] == [
        (["body", "capacity", "slos", "ttft_ms", "p99"], "capacity_too_few_requests")
    ]
    assert "at least 368" in errors[0]["msg"] and "holds 120" in errors[0]["msg"]
    # requests_per_step is a floor: raising it does not help at that rate
    _, errors = expand(capacity_spec({**p99, "requests_per_step": 400}))
    assert [e["type"] for e in errors] == ["capacity_too_few_requests"]
    # a higher min does: 461 requests at 2 req/s arrive in 230 s
    assert expand(capacity_spec({**p99, "min": 2}))[1] == []


def test_steps_that_cannot_reach_a_steady_state_are_refused() -> None:
    # max_step_s under min_step_s: no step could last long enough
    with pytest.raises(ValidationError, match="max_step_s"):
        capacity_spec({**CAPACITY, "min_step_s": 60, "max_step_s": 30})
    # the floor of requests at min takes longer than max_step_s
    _, errors = expand(capacity_spec({**CAPACITY, "requests_per_step": 2000}))
    assert [(e["loc"], e["type"]) for e in errors] == [
        (["body", "capacity", "max_step_s"], "capacity_no_steady_state")
    ]
    assert "2000 requests" in errors[0]["msg"] and "3998 s" in errors[0]["msg"]
    # the request list cannot hold the shortest step at max
    _, errors = expand(capacity_spec({**CAPACITY, "max": 4000, "min_step_s": 10}))
    assert [(e["loc"], e["type"]) for e in errors] == [
        (["body", "capacity", "max"], "capacity_no_steady_state")
    ]
    assert "40001 requests" in errors[0]["msg"]
    # a replay too short for a step's requests
    bodies = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(30)]
    replay = {**OPEN_LOOP, "kind": "replay", "replay": bodies}
    _, errors = expand(
        capacity_spec(
            baseline={"engine_args": {"enable_prefix_caching": False}, "workload": replay}
        )
    )
    assert {e["type"] for e in errors} == {"capacity_no_steady_state"}
    assert any("replay's 30 bodies" in e["msg"] for e in errors)


def test_the_search_time_bound() -> None:
    s = capacity_spec({**CAPACITY, "max_steps": 10, "max_step_s": 60, "max_drain_s": 20})
    assert s.capacity is not None
    bound = search_time_bound(s.capacity, runs=4)
    # 10 steps of 60 s and 20 s of drain, and the load generator's calibration
    assert bound["run_s_max"] == 10 * (60 + 20) + 10 and bound["experiment_s_max"] == 4 * 810
    assert "at most 10 steps" in bound["note"] and "10 s of load-generator" in bound["note"]
    s = capacity_spec({**CAPACITY, "max_steps": 10, "max_step_s": 60, "max_drain_s": 20})
    assert s.capacity is not None
    uncalibrated = s.capacity.model_copy(update={"calibrate_client": False})
    assert search_time_bound(uncalibrated, runs=4)["run_s_max"] == 10 * (60 + 20)
