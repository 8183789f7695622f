"""Spec validation and expansion: one variable per variant, every bad field named."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from orchestrator.service import validate_spec
from orchestrator.spec import ExperimentSpec, expand
from tests.factories import real_catalog


def spec(**kw):  # type: ignore[no-untyped-def]
    doc = {
        "name": "t",
        "model": "tiny",
        "baseline": {"engine_args": {"enable_prefix_caching": False}},
        "variants": [{"name": "apc", "changes": {"engine_args.enable_prefix_caching": True}}],
    }
    doc.update(kw)
    return ExperimentSpec.model_validate(doc)


def test_expands_baseline_and_one_run_per_variant() -> None:
    runs, errors = expand(spec())
    assert errors == []
    assert [r.name for r in runs] == ["baseline", "apc"]
    assert runs[0].config.engine_args == {"enable_prefix_caching": False}
    assert runs[1].config.engine_args == {"enable_prefix_caching": True}
    # everything else inherited
    assert runs[1].config.workload == runs[0].config.workload
    assert runs[1].config.layout == runs[0].config.layout


def test_variant_changing_two_variables_is_refused_naming_both() -> None:
    s = spec(
        variants=[
            {
                "name": "two",
                "changes": {
                    "engine_args.enable_prefix_caching": True,
                    "workload.concurrency": 4,
                },
            }
        ]
    )
    _, errors = expand(s)
    assert len(errors) == 1
    assert errors[0]["type"] == "more_than_one_variable"
    assert "engine_args.enable_prefix_caching" in errors[0]["msg"]
    assert "workload.concurrency" in errors[0]["msg"]


def test_variant_that_changes_nothing_is_refused() -> None:
    s = spec(variants=[{"name": "same", "changes": {"engine_args.enable_prefix_caching": False}}])
    _, errors = expand(s)
    assert [e["type"] for e in errors] == ["no_change"]


def test_invalid_workload_value_in_variant_is_reported_with_location() -> None:
    s = spec(variants=[{"name": "bad", "changes": {"workload.concurrency": 0}}])
    _, errors = expand(s)
    assert errors and errors[0]["loc"][:4] == ["body", "variants", 0, "changes"]
    assert "workload.concurrency" in errors[0]["loc"][-1]


def test_bad_paths_and_fields_are_rejected_by_the_schema() -> None:
    with pytest.raises(ValidationError) as exc:
        ExperimentSpec.model_validate(
            {
                "name": "",
                "model": "tiny",
                "baseline": {"layout": {"tensor_parallel_size": 0}, "bogus": 1},
                "variants": [{"name": "x", "changes": {"nope.thing": 1}}],
            }
        )
    locs = {tuple(e["loc"]) for e in exc.value.errors()}
    assert ("name",) in locs
    assert ("baseline", "layout", "tensor_parallel_size") in locs
    assert ("baseline", "bogus") in locs
    assert ("variants", 0, "changes") in locs


def test_unknown_engine_argument_is_refused_with_a_suggestion() -> None:
    s = spec(baseline={"engine_args": {"enable_prefix_cache": True, "max_num_seqs": 8}})
    _, errors = validate_spec(s, real_catalog())
    unknown = [e for e in errors if e["type"] == "unknown_engine_arg"]
    assert len(unknown) == 1
    assert unknown[0]["loc"] == ["body", "baseline", "engine_args", "enable_prefix_cache"]
    assert "enable_prefix_caching" in unknown[0]["msg"]


def test_engine_argument_values_are_type_checked() -> None:
    s = spec(
        baseline={"engine_args": {"enable_prefix_caching": "yes", "max_num_seqs": 1.5}},
        variants=[{"name": "d", "changes": {"engine_args.dtype": "float8"}}],
    )
    _, errors = validate_spec(s, real_catalog())
    by_name = {e["loc"][-1]: e for e in errors}
    assert by_name["enable_prefix_caching"]["type"] == "bad_engine_arg_value"
    assert by_name["max_num_seqs"]["type"] == "bad_engine_arg_value"
    assert by_name["engine_args.dtype"]["type"] == "bad_engine_arg_value"


def test_reserved_arguments_point_at_the_right_field() -> None:
    s = spec(baseline={"engine_args": {"tensor_parallel_size": 2, "port": 1}})
    _, errors = validate_spec(s, real_catalog())
    msgs = {e["loc"][-1]: e["msg"] for e in errors}
    assert "layout.tensor_parallel_size" in msgs["tensor_parallel_size"]
    assert "port" in msgs


def test_resolved_engine_args_carry_every_vllm_default() -> None:
    cat = real_catalog()
    resolved = cat.resolve({"enable_prefix_caching": True})
    assert resolved["enable_prefix_caching"] is True
    assert resolved["gpu_memory_utilization"] == 0.92
    assert len(resolved) == len(cat.args)
