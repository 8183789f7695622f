"""Planning: engine-argument checks, cluster size, vLLM-resolved derived defaults, run layout."""

from __future__ import annotations

from typing import Any

from orchestrator.experiments.planner import plan_experiment
from orchestrator.experiments.run_layout import server_key
from orchestrator.experiments.spec import ExperimentSpec
from tests.factories import real_catalog


def make(**kw: Any) -> ExperimentSpec:
    doc: dict[str, Any] = {
        "name": "t",
        "model": "tiny",
        "baseline": {"engine_args": {"enable_prefix_caching": False, "max_model_len": 2048}},
        "variants": [{"name": "apc", "changes": {"engine_args.enable_prefix_caching": True}}],
        "repeats": 3,
    }
    doc.update(kw)
    return ExperimentSpec.model_validate(doc)


def plan(spec: ExperimentSpec, **kw: Any):  # type: ignore[no-untyped-def]
    return plan_experiment(
        spec, real_catalog(), model_dir="/m", model_digest="d" * 64, generated_model=True, **kw
    )


def test_runs_are_interleaved_repeats_with_full_resolved_args() -> None:
    p = plan(make())
    assert p.errors == []
    assert [(r.variant.name, r.repeat_index, r.sequence) for r in p.runs] == [
        ("baseline", 0, 0),
        ("apc", 0, 1),
        ("baseline", 1, 2),
        ("apc", 1, 3),
        ("baseline", 2, 4),
        ("apc", 2, 5),
    ]
    r = p.runs[1]
    assert r.explicit_engine_args["load_format"] == "dummy"
    assert r.resolved_engine_args["enable_prefix_caching"] is True
    assert r.resolved_engine_args["gpu_memory_utilization"] == 0.92  # vLLM's default


def test_client_side_variants_share_a_server_key() -> None:
    p = plan(make(variants=[{"name": "c4", "changes": {"workload.concurrency": 4}}]))
    keys = {r.variant.name: r.server_key for r in p.runs}
    assert keys["baseline"] == keys["c4"]
    p2 = plan(make())
    keys2 = {r.variant.name: r.server_key for r in p2.runs}
    assert keys2["baseline"] != keys2["apc"]
    assert server_key("a", {"x": 1}, {}) != server_key("b", {"x": 1}, {})


def test_unknown_engine_argument_in_baseline_and_variants() -> None:
    p = plan(
        make(
            baseline={"engine_args": {"enable_prefix_cache": True}},
            variants=[{"name": "x", "changes": {"engine_args.max_num_seq": 4}}],
        )
    )
    got = {(".".join(map(str, e["loc"])), e["type"]) for e in p.errors}
    assert ("body.baseline.engine_args.enable_prefix_cache", "unknown_engine_arg") in got
    assert ("body.variants.0.changes.engine_args.max_num_seq", "unknown_engine_arg") in got
    assert p.runs == []


def test_more_devices_than_the_cluster_has_is_refused() -> None:
    s = make(
        baseline={"layout": {"tensor_parallel_size": 4}},
        variants=[{"name": "w", "changes": {"workload.concurrency": 2}}],
    )
    p = plan(s, cluster_devices=2)
    assert {e["type"] for e in p.errors} == {"cluster_too_small"}
    assert "needs 4 devices; the cluster has 2" in p.errors[0]["msg"]
    assert plan(s, cluster_devices=4).errors == []


def test_vllm_refusing_a_config_is_a_problem() -> None:
    def resolver(model_dir: str, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {"ok": False, "error": "User-specified max_model_len (99999) is greater"}
            if c.get("enable_prefix_caching")
            else {"ok": True, "config": {"model_config.max_model_len": 2048}}
            for c in configs
        ]

    p = plan(make(), resolver=resolver)
    assert [e["type"] for e in p.errors] == ["engine_refuses_config"]
    assert "max_model_len (99999)" in p.errors[0]["msg"]


def test_a_default_vllm_derives_from_the_change_counts_as_a_second_variable() -> None:
    """vLLM output shape as printed by ``vllm_launcher.py resolve`` (flattened sub-configs)."""

    def resolver(model_dir: str, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for c in configs:
            mml = c.get("max_model_len", 2048)
            out.append(
                {
                    "ok": True,
                    "config": {
                        "model_config.max_model_len": mml,
                        "scheduler_config.max_num_batched_tokens": max(2048, mml),
                        "cache_config.enable_prefix_caching": bool(c.get("enable_prefix_caching")),
                    },
                }
            )
        return out

    bad = plan(
        make(variants=[{"name": "ctx", "changes": {"engine_args.max_model_len": 8192}}]),
        resolver=resolver,
    )
    assert [e["type"] for e in bad.errors] == ["derived_default_changes"]
    assert "max_num_batched_tokens: 2048 -> 8192" in bad.errors[0]["msg"]
    ok = plan(make(), resolver=resolver)
    assert ok.errors == []
    assert ok.runs[1].resolved_config == {
        "model_config.max_model_len": 2048,
        "scheduler_config.max_num_batched_tokens": 2048,
        "cache_config.enable_prefix_caching": True,
    }


def test_ladder_pins_scheduler_limits_vllm_scales_with_world_size() -> None:
    """vLLM 0.32 (CPU) resolves max_num_batched_tokens = 2048 x TP and max_num_seqs = 128 x TP
    when they are unset (measured with ``vllm_launcher.py resolve``)."""

    def resolver(model_dir: str, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for c in configs:
            tp = c["tensor_parallel_size"]
            out.append(
                {
                    "ok": True,
                    "config": {
                        "scheduler_config.max_num_batched_tokens": c.get(
                            "max_num_batched_tokens", 2048 * tp
                        ),
                        "scheduler_config.max_num_seqs": c.get("max_num_seqs", 128 * tp),
                        "parallel_config.tensor_parallel_size": tp,
                        "cache_config.enable_prefix_caching": c.get("enable_prefix_caching"),
                    },
                }
            )
        return out

    s = make(
        variants=[],
        preset="ladder",
        repeats=1,
        baseline={
            "engine_args": {"max_model_len": 2048},
            "workload": {"prefix_tokens": 256, "long_input_tokens": 1024},
        },
    )
    p = plan(s, resolver=resolver)
    assert p.errors == []
    assert p.pinned == {"max_num_batched_tokens": 2048, "max_num_seqs": 128}
    tp_run = next(r for r in p.runs if r.variant.name == "3-tp2")
    assert tp_run.explicit_engine_args["max_num_batched_tokens"] == 2048
    assert tp_run.explicit_engine_args["tensor_parallel_size"] == 2
    # without the pins the TP step is refused: vLLM would change two more settings
    s2 = make(
        variants=[{"name": "tp2", "changes": {"layout.tensor_parallel_size": 2}}],
        baseline={"layout": {"devices": 2}},
        repeats=1,
    )
    p2 = plan(s2, resolver=resolver)
    assert [e["type"] for e in p2.errors] == ["derived_default_changes"]
    assert "max_num_seqs: 128 -> 256" in p2.errors[0]["msg"]


def test_requests_longer_than_the_context_cap_are_refused() -> None:
    s = make(
        variants=[{"name": "long", "changes": {"workload.long_fraction": 0.5}}],
        baseline={
            "engine_args": {"max_model_len": 1024},
            "workload": {"prefix_tokens": 512, "long_input_tokens": 1024},
        },
    )
    p = plan(s)
    assert [e["type"] for e in p.errors] == ["request_exceeds_context_cap"]
    assert "above max_model_len 1024" in p.errors[0]["msg"]
    assert p.errors[0]["loc"] == ["body", "variants", 0, "workload"]


def test_human_readable_ints_are_accepted_and_read_as_vllm_does() -> None:
    from orchestrator.experiments.engine_catalog import parse_human_int

    assert parse_human_int("2k") == 2000 and parse_human_int("2K") == 2048
    assert parse_human_int("1.5M") == 1_572_864 and parse_human_int(4096) == 4096
    assert parse_human_int("auto") is None and parse_human_int(True) is None
    for ok in (4096, "4k", "auto"):
        s = make(baseline={"engine_args": {"max_model_len": ok}})
        assert plan(s).errors == [], ok
    for bad in ("abc", True, "4kb"):
        s = make(baseline={"engine_args": {"max_model_len": bad}})
        assert [e["type"] for e in plan(s).errors] == ["bad_engine_arg_value"], bad


def test_a_change_vllm_resolves_to_the_same_value_is_refused() -> None:
    """vLLM V1 turns prefix caching on by default: 'unset' and True resolve alike."""

    def resolver(model_dir: str, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {
                "ok": True,
                "config": {
                    "cache_config.enable_prefix_caching": c.get("enable_prefix_caching", True),
                    "model_config.max_model_len": 2048,
                },
            }
            for c in configs
        ]

    s = make(
        baseline={"engine_args": {"max_model_len": 2048}},
        variants=[{"name": "apc", "changes": {"engine_args.enable_prefix_caching": True}}],
    )
    p = plan(s, resolver=resolver)
    assert [e["type"] for e in p.errors] == ["no_change"]
    assert "enable_prefix_caching=True" in p.errors[0]["msg"]
    ok = plan(make(), resolver=resolver)
    assert ok.errors == []
    # vLLM's value replaces the catalogue's None in the stored resolved arguments
    base = next(r for r in ok.runs if r.variant.name == "baseline")
    assert base.resolved_engine_args["enable_prefix_caching"] is False


def test_two_levels_spelled_differently_but_equal_are_one_configuration() -> None:
    s = make(
        variants=[],
        factors=[{"name": "m", "paths": ["engine_args.max_model_len"], "levels": ["2k", 2000]}],
    )

    def resolver(model_dir: str, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from orchestrator.experiments.engine_catalog import parse_human_int

        return [
            {
                "ok": True,
                "config": {
                    "model_config.max_model_len": parse_human_int(c.get("max_model_len")),
                    "cache_config.enable_prefix_caching": bool(c.get("enable_prefix_caching")),
                },
            }
            for c in configs
        ]

    p = plan(s, resolver=resolver)
    assert [e["type"] for e in p.errors] == ["duplicate_variant"]
    assert "'m=2000' runs exactly the same configuration as 'm=2k'" in p.errors[0]["msg"]


def test_ladder_refuses_a_baseline_that_sets_what_the_ladder_sets() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="enable_prefix_caching"):
        make(variants=[], preset="ladder")
    with pytest.raises(ValidationError, match="layout.tensor_parallel_size"):
        make(
            variants=[],
            preset="ladder",
            baseline={"layout": {"tensor_parallel_size": 2}},
        )
