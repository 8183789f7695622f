"""Tests for orchestrator.cluster.parity: real-world cases plus generality cases."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cluster.parity import RULES, check_parity, rule_for

DATA = Path(__file__).parent / "data" / "parity"
CASES = sorted(DATA.glob("*.json"))


def _project(actual: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """``actual`` restricted to the keys the case's expected entry names."""
    return {k: actual.get(k) for k in expected}


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_case_matches_expected(path: Path) -> None:
    case = json.loads(path.read_text())
    expected = case["expected"]
    report = check_parity(case["nodes"], case["launch"])
    assert report["verdict"] == expected["verdict"]
    assert len(report["mismatches"]) == len(expected["mismatches"])
    for got, want in zip(report["mismatches"], expected["mismatches"], strict=True):
        assert _project(got, want) == want
        assert got["rule"] and got["odd_nodes"]


def test_drift_case_names_odd_nodes() -> None:
    case = json.loads((DATA / "python_ray_vllm_drift.json").read_text())
    report = check_parity(case["nodes"], case["launch"])
    odd = {m["field"]: m["odd_nodes"] for m in report["mismatches"]}
    assert odd == {"python": ["node-1"], "ray": ["node-2"], "vllm": ["node-2"]}


def _node(name: str, ip: str, **extra: Any) -> dict[str, Any]:
    node: dict[str, Any] = {
        "node": name,
        "ip": ip,
        "python": "3.11.9",
        "ray": "2.60.0",
        "vllm": "0.11.0",
        "torch": "2.8.0+cu128",
        "cuda_runtime": "12.8",
        "nccl": "2.26.2",
        "nvidia_driver": "570.86.15",
        "gpu_model": "NVIDIA L4",
        "gpu_count": 4,
        "gpu_memory_mib": 23034,
        "model_files": {"config.json": {"size": 700, "sha256": "ab" * 32}},
        "env": {"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "eth0", "HF_HOME": "/hf"},
        "interfaces": ["lo", "eth0"],
        "engine_args": {"max_model_len": 8192, "node_rank": 0},
    }
    node.update(extra)
    return node


def _pair() -> list[dict[str, Any]]:
    b = _node("b", "10.0.0.2")
    b["engine_args"] = {"max_model_len": 8192, "node_rank": 1}
    return [_node("a", "10.0.0.1"), b]


LAUNCH = {"tensor_parallel_size": 4, "pipeline_parallel_size": 2, "gpus_per_node": 4}


def test_all_match_is_ok() -> None:
    report = check_parity(_pair(), LAUNCH)
    assert report == {
        "verdict": "ok",
        "mismatches": [],
        "warnings": [],
        "nodes": ["a", "b"],
        "unchecked_fields": [],
    }


def test_missing_interface_blocks_only_that_node() -> None:
    nodes = _pair()
    nodes[1]["interfaces"] = [{"name": "lo"}, {"name": "ens5"}]
    report = check_parity(nodes, LAUNCH)
    assert report["verdict"] == "blocked"
    fields = {m["field"]: m for m in report["mismatches"]}
    assert set(fields) == {"env.NCCL_SOCKET_IFNAME", "env.GLOO_SOCKET_IFNAME"}
    for m in fields.values():
        assert m["odd_nodes"] == ["b"]
        assert set(m["values"]) == {"a", "b"}


def test_nccl_ifname_semantics() -> None:
    nodes = _pair()
    for node in nodes:
        node["env"] = {"NCCL_SOCKET_IFNAME": "^lo,docker"}
    nodes[1]["interfaces"] = ["lo", "docker0"]
    report = check_parity(nodes, LAUNCH)
    assert [m["odd_nodes"] for m in report["mismatches"]] == [["b"]]
    nodes[1]["interfaces"] = ["lo", "ens5"]
    assert check_parity(nodes, LAUNCH)["verdict"] == "ok"
    for node in nodes:
        node["env"] = {"NCCL_SOCKET_IFNAME": "=eth"}
    assert check_parity(nodes, LAUNCH)["verdict"] == "blocked"


def test_duplicate_vllm_host_ip_blocks() -> None:
    nodes = _pair()
    nodes[0]["env"]["VLLM_HOST_IP"] = "10.0.0.1"
    nodes[1]["env"]["VLLM_HOST_IP"] = "10.0.0.1"
    report = check_parity(nodes, LAUNCH)
    assert report["verdict"] == "blocked"
    (m,) = report["mismatches"]
    assert m["field"] == "env.VLLM_HOST_IP"
    assert m["odd_nodes"] == ["a", "b"]
    assert "Ray IP" in m["problems"]["b"] and "same VLLM_HOST_IP" in m["problems"]["a"]


def test_vllm_host_ip_set_correctly_is_ok() -> None:
    nodes = _pair()
    nodes[0]["env"]["VLLM_HOST_IP"] = "10.0.0.1"
    nodes[1]["env"]["VLLM_HOST_IP"] = "10.0.0.2"
    assert check_parity(nodes, LAUNCH)["verdict"] == "ok"


def test_warn_only_field_differs_is_ok_with_warning() -> None:
    nodes = _pair()
    nodes[1]["nvidia_driver"] = "570.124.06"
    nodes[1]["env"]["HF_HOME"] = "/data/hf"
    report = check_parity(nodes, LAUNCH)
    assert report["verdict"] == "ok"
    assert report["mismatches"] == []
    assert {w["field"] for w in report["warnings"]} == {"nvidia_driver", "env.HF_HOME"}
    assert all(w["severity"] == "warning" for w in report["warnings"])


def test_engine_args_and_env_differences_block() -> None:
    nodes = _pair()
    nodes[1]["engine_args"]["max_model_len"] = 4096
    nodes[1]["env"]["NCCL_IB_DISABLE"] = "1"
    report = check_parity(nodes, LAUNCH)
    fields = {m["field"]: m for m in report["mismatches"]}
    assert set(fields) == {"engine_args.max_model_len", "env.NCCL_IB_DISABLE"}
    assert fields["env.NCCL_IB_DISABLE"]["values"] == {"a": None, "b": "1"}


def test_model_files_dict_shape_and_extra_file() -> None:
    nodes = [_node(n, f"10.0.0.{i}") for i, n in enumerate("abc")]
    nodes[2]["model_files"] = {
        "config.json": {"size": 701, "sha256": "cd" * 32},
        "stray.bin": {"size": 1, "sha256": "ef" * 32},
    }
    report = check_parity(nodes)
    (m,) = report["mismatches"]
    assert m == {
        "node": "c",
        "field": "model_files",
        "differs": ["config.json"],
        "extra": ["stray.bin"],
        "severity": "blocking",
        "odd_nodes": ["c"],
        "rule": m["rule"],
    }


def test_secret_env_values_are_not_shown() -> None:
    nodes = _pair()
    nodes[0]["env"]["VLLM_API_KEY"] = "hunter2"
    report = check_parity(nodes, LAUNCH)
    (m,) = report["mismatches"]
    assert m["values"]["a"].startswith("<set sha256:") and m["values"]["b"] is None
    assert "hunter2" not in json.dumps(report)


def test_gpu_count_below_launch_needs_blocks() -> None:
    nodes = _pair()
    nodes[1]["gpu_count"] = 2
    report = check_parity(nodes, LAUNCH)
    fields = [m["field"] for m in report["mismatches"]]
    assert fields == ["gpu_count", "gpu_count"]
    assert report["mismatches"][0]["odd_nodes"] == ["b"]


def test_tie_breaks_toward_first_node_and_input_unchanged() -> None:
    nodes = _pair()
    nodes[1]["torch"] = "2.7.1"
    before = copy.deepcopy(nodes)
    (m,) = check_parity(nodes, LAUNCH)["mismatches"]
    assert m["odd_nodes"] == ["b"]
    assert nodes == before


def test_rules_table_is_consistent() -> None:
    assert {r.check for r in RULES} <= {"identical", "per_node", "ignore"}
    assert {r.severity for r in RULES} <= {"blocking", "warning"}
    assert rule_for("env.NCCL_SOCKET_IFNAME").check == "per_node"  # type: ignore[union-attr]
    assert rule_for("env.NCCL_IB_HCA").severity == "blocking"  # type: ignore[union-attr]
    assert rule_for("engine_args.node_rank").check == "ignore"  # type: ignore[union-attr]


def test_empty_and_duplicate_nodes_rejected() -> None:
    with pytest.raises(ValueError):
        check_parity([])
    with pytest.raises(ValueError):
        check_parity([_node("a", "1"), _node("a", "2")])


def test_rules_document_matches_the_table() -> None:
    from pathlib import Path

    from orchestrator.cluster.parity import rules_markdown

    doc = (Path(__file__).resolve().parents[3] / "docs" / "PARITY.md").read_text()
    assert doc.endswith(rules_markdown())


# --------------------------------------------------------------------------- model revision

SHA_MAIN = "9c" * 20
SHA_OLD = "1f" * 20


def _by_id(name: str, ip: str, revision: str | None, source: str | None = "hf_cache") -> dict:
    """A node fingerprinted with ``fingerprint --model acme/tiny-chat``."""
    return _node(name, ip, model_source=source, model_revision=revision)


def test_same_model_revision_everywhere_is_ok() -> None:
    nodes = [_by_id(n, f"10.0.0.{i}", SHA_MAIN) for i, n in enumerate("abc")]
    report = check_parity(nodes, {**LAUNCH, "model": "acme/tiny-chat"})
    assert report["verdict"] == "ok"
    assert report["warnings"] == [] and report["unchecked_fields"] == []


def test_other_snapshot_in_one_nodes_cache_blocks_naming_that_node() -> None:
    nodes = [_by_id(n, f"10.0.0.{i}", SHA_MAIN) for i, n in enumerate("abc")]
    nodes[1]["model_revision"] = SHA_OLD
    report = check_parity(nodes, {**LAUNCH, "model": "acme/tiny-chat"})
    assert report["verdict"] == "blocked"
    (m,) = report["mismatches"]
    assert m["field"] == "model_revision"
    assert m["odd_nodes"] == ["b"]
    assert m["values"] == {"a": SHA_MAIN, "b": SHA_OLD, "c": SHA_MAIN}
    assert m["severity"] == "blocking" and "revision" in m["rule"]
    rule = rule_for("model_revision")
    assert rule is not None and (rule.check, rule.severity) == ("identical", "blocking")


def test_model_revision_reported_before_model_files() -> None:
    nodes = _pair()
    nodes[0].update(model_source="hf_cache", model_revision=SHA_MAIN)
    nodes[1].update(model_source="hf_cache", model_revision=SHA_OLD)
    nodes[1]["model_files"] = {"config.json": {"size": 701, "sha256": "cd" * 32}}
    report = check_parity(nodes, LAUNCH)
    assert [m["field"] for m in report["mismatches"]] == ["model_revision", "model_files"]
    assert [m["odd_nodes"] for m in report["mismatches"]] == [["b"], ["b"]]


def test_model_source_differs_only_warns() -> None:
    nodes = [
        _by_id("a", "10.0.0.1", None, "local_dir"),
        _by_id("b", "10.0.0.2", None, "model_root"),
    ]
    report = check_parity(nodes, LAUNCH)
    assert report["verdict"] == "ok"
    (w,) = report["warnings"]
    assert w["field"] == "model_source" and w["odd_nodes"] == ["b"]


def test_unresolved_model_blocks_with_the_nodes_reason() -> None:
    error = "acme/tiny-chat (revision main) is not in the Hugging Face cache at /hf/hub and ..."
    nodes = _pair()
    nodes[0].update(model_source="hf_cache", model_revision=SHA_MAIN, model_path="/hf/x")
    nodes[1].update(
        model_source=None,
        model_revision=None,
        model_path=None,
        model_path_exists=False,
        model_files=[],
        model_error=error,
    )
    report = check_parity(nodes, {**LAUNCH, "model": "acme/tiny-chat"})
    assert report["verdict"] == "blocked"
    by_field = {m["field"]: m for m in report["mismatches"]}
    assert by_field["model_revision"]["odd_nodes"] == ["b"]
    missing = by_field["model_files"]
    assert missing["node"] == "b" and missing["missing_model_path"] == "acme/tiny-chat"
    assert missing["error"] == error
    assert "model_error" not in report["unchecked_fields"]


def test_fingerprints_without_model_revision_are_unaffected() -> None:
    nodes = _pair()  # --model-dir fingerprints: no model_revision/model_source at all
    report = check_parity(nodes, LAUNCH)
    assert report["verdict"] == "ok" and report["warnings"] == []
