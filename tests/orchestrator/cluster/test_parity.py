"""Tests for orchestrator.cluster.parity: real-world cases plus generality cases."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from jobs.engine.nodeprobe import ENV_NAMES, ENV_PREFIXES, env_scope, launch_environment, probe_node
from jobs.launcher import fingerprint as launcher_fingerprint
from orchestrator.cluster.parity import RULES, check_parity, rule_for, rules_for
from orchestrator.core.settings import EngineSettings, Settings
from orchestrator.dispatch.ray import backend as backend_module

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
    assert report["verdict"] == "ok"
    assert report["mismatches"] == [] and report["warnings"] == []
    assert report["nodes"] == ["a", "b"] and report["unchecked_fields"] == []
    # no launching environment was given: said, not passed over in silence
    assert report["unknown"] == [
        {"field": None, "rule": "comm_launch_shell_only", "note": report["unknown"][0]["note"]}
    ]
    assert "launching environment" in report["unknown"][0]["note"]
    assert report["launch_env_source"] is None
    assert {e["verdict"] for e in report["evaluations"]} <= {"ok", "unknown", "ignored"}


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
    checks = {
        "identical",
        "per_node",
        "present_everywhere",
        "launch_env",
        "launch_env_same",
        "ignore",
    }
    assert {r.check for r in RULES} <= checks
    assert {r.severity for r in RULES} <= {"blocking", "warning"}
    assert len({r.name for r in RULES}) == len(RULES)
    ifname = {r.name: r.check for r in rules_for("env.NCCL_SOCKET_IFNAME")}
    assert ifname == {
        "comm_launch_shell_only": "launch_env",
        "comm_launch_shell_differs": "launch_env_same",
        "comm_set_everywhere": "present_everywhere",
        "socket_ifname_exists": "per_node",
        "socket_ifname_same": "identical",
    }
    assert {r.name for r in rules_for("env.NCCL_IB_HCA")} == {
        "comm_launch_shell_only",
        "comm_launch_shell_differs",
        "comm_set_everywhere",
        "nccl_same",
    }
    assert {r.name for r in rules_for("env.NCCL_IB_HCA") if r.severity == "warning"} == {
        "comm_launch_shell_differs"
    }
    # a per-node variable is never compared with the launching shell's value
    assert "comm_launch_shell_differs" not in {r.name for r in rules_for("env.VLLM_HOST_IP")}
    assert [r.check for r in rules_for("engine_args.node_rank")] == ["ignore"]
    assert rule_for("engine_args.max_model_len").name == "engine_args"  # type: ignore[union-attr]
    # VLLM_HOST_IP differs per node by design: never compared for identity
    assert "identical" not in {r.check for r in rules_for("env.VLLM_HOST_IP")}
    assert [r.name for r in rules_for("env.NCCL_DEBUG")] == ["nccl_debug"]


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


# --------------------------------------------------------------------------- every rule runs
#
# Shapes below come from public reports and from the sources that decide what a
# variable does:
# - vllm-project/vllm#44878 (collect_env "Environment Variables" of a 4-node Ray
#   cluster): NCCL_SOCKET_IFNAME=ib0, NCCL_IB_HCA=mlx5_0, NCCL_IB_DISABLE=0,
#   VLLM_HOST_IP=192.168.10.219, NIC mlx5_0;
# - vllm-project/vllm#7074 (vLLM 0.5.3.post1, two nodes, eth0 the controller network,
#   eth1..eth8 RoCE): `GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0
#   TP_SOCKET_IFNAME="eth0" vllm serve /models --tensor-parallel-size 16` typed on the
#   head; the Ray worker on 10.41.0.8 then logs "Unable to resolve hostname to a
#   (local) address. Using the loopback address as fallback. Manually set the network
#   interface to bind to with GLOO_SOCKET_IFNAME" and "Gloo connectFullMesh failed";
# - vllm-project/vllm#5779 (vLLM 0.4.3, Ray 2.24): the same two variables set with
#   os.environ[...] in the driver script only;
# - NVIDIA/nccl#1686 (vLLM's Ray executor log): "Copying the following environment
#   variables to workers: ['LD_LIBRARY_PATH', 'VLLM_USAGE_SOURCE', 'VLLM_LOGGING_LEVEL',
#   'VLLM_WORKER_MULTIPROC_METHOD', 'VLLM_USE_V1']": no NCCL_/GLOO_ variable reached
#   the workers;
# - vLLM 0.32 (.engine-venv): vllm/v1/executor/ray_utils.py:33 WORKER_SPECIFIC_ENV_VARS
#   (VLLM_HOST_IP is never copied to a Ray worker), vllm/ray/ray_env.py:36
#   DEFAULT_ENV_VAR_PREFIXES (no GLOO_), vllm/envs.py:1515 VLLM_DP_RANK;
#   examples/online_serving/run_cluster.sh: "-e VLLM_HOST_IP=<worker_node_ip> ...
#   Each worker requires a unique VLLM_HOST_IP value";
# - NCCL src/misc/socket.cc ncclFindInterfaces (`strlen(env) > 1`) and torch
#   ProcessGroupGloo.cpp create_default (`ifnameEnv->size() > 1`): a value under two
#   characters is ignored; NCCL src/transport/net_ib.cc NCCL_PARAM(IbPkey, "IB_PKEY").

SCOPE = {
    "prefixes": ["NCCL_", "GLOO_", "VLLM_", "HF_", "UCX_", "TORCH_"],
    "names": ["CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"]
    + ["TP_SOCKET_IFNAME"],
}


def _ray_node(name: str, ip: str, env: dict[str, str], ifaces: list[str]) -> dict[str, Any]:
    """A fingerprint as the probe now sends it: ``env`` with its ``env_scope``."""
    return _node(name, ip, env=env, env_scope=SCOPE, interfaces=ifaces)


def _ib_cluster(n: int = 4) -> list[dict[str, Any]]:
    """vllm-project/vllm#44878: every node with ib0 / mlx5_0 set, VLLM_HOST_IP its own."""
    nodes = []
    for i in range(n):
        ip = f"192.168.10.{219 + i}"
        env = {
            "NCCL_SOCKET_IFNAME": "ib0",
            "NCCL_IB_HCA": "mlx5_0",
            "NCCL_IB_DISABLE": "0",
            "VLLM_HOST_IP": ip,
        }
        nodes.append(_ray_node(f"node{i}", ip, env, ["lo", "eno1", "ib0"]))
    return nodes


def _verdicts(finding: dict[str, Any]) -> dict[str, str]:
    return {v["rule"]: v["verdict"] for v in finding["rules"]}


def test_the_ib_cluster_as_reported_passes() -> None:
    report = check_parity(_ib_cluster(), {**LAUNCH, "launch_env": {}})
    assert report["verdict"] == "ok", report["mismatches"]
    assert report["warnings"] == [] and report["unknown"] == []


def test_a_field_matched_by_several_rules_reports_each_verdict() -> None:
    """The first-match bug: env.NCCL_SOCKET_IFNAME matched the per-node interface row
    first, so neither the 'identical' row nor any other ran for it. Now every row that
    applies is evaluated and listed."""
    nodes = _ib_cluster(2)
    nodes[1]["env"]["NCCL_SOCKET_IFNAME"] = "ib1"  # ib1 does not exist on node1
    report = check_parity(nodes, {**LAUNCH, "launch_env": {}})
    (m,) = report["mismatches"]
    assert m["field"] == "env.NCCL_SOCKET_IFNAME"
    assert _verdicts(m) == {
        "comm_launch_shell_only": "ok",
        "comm_launch_shell_differs": "ok",
        "comm_set_everywhere": "ok",
        "socket_ifname_exists": "blocking",
        "socket_ifname_same": "warning",
    }
    assert m["rule_name"] == "socket_ifname_exists" and m["odd_nodes"] == ["node1"]
    assert "selects no interface" in m["problems"]["node1"]
    for verdict in m["rules"]:
        assert verdict["why"] and verdict["check"] and verdict["severity"]
    evaluated = [e["rule"] for e in report["evaluations"] if e["field"] == m["field"]]
    assert evaluated == [v["rule"] for v in m["rules"]]


def test_identical_row_runs_for_socket_ifname_when_each_value_is_valid() -> None:
    """Different interface names, each present on its node: the 'identical' row now
    runs (a warning: valid only where both are on the same network), nothing blocks."""
    nodes = _ib_cluster(2)
    nodes[1]["env"]["NCCL_SOCKET_IFNAME"] = "eno1"
    report = check_parity(nodes, {**LAUNCH, "launch_env": {}})
    assert report["verdict"] == "ok"
    (w,) = report["warnings"]
    assert w["field"] == "env.NCCL_SOCKET_IFNAME" and w["rule_name"] == "socket_ifname_same"
    assert _verdicts(w)["socket_ifname_exists"] == "ok"


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("NCCL_SOCKET_IFNAME", "ib0"),
        ("GLOO_SOCKET_IFNAME", "eth0"),
        ("TP_SOCKET_IFNAME", "eth0"),
        ("NCCL_IB_HCA", "mlx5_0"),
        ("NCCL_IB_GID_INDEX", "3"),
        ("NCCL_P2P_DISABLE", "1"),
        ("NCCL_NET_GDR_LEVEL", "PHB"),
        ("NCCL_NET", "IB"),
        ("UCX_NET_DEVICES", "mlx5_0:1"),
        ("MASTER_ADDR", "192.168.10.219"),
        ("MASTER_PORT", "29500"),
        ("VLLM_HOST_IP", "192.168.10.219"),
        ("VLLM_PORT", "51000"),
        ("VLLM_DP_MASTER_IP", "192.168.10.219"),
    ],
)
def test_comm_setting_on_one_node_only_blocks_naming_the_nodes_without_it(
    var: str, value: str
) -> None:
    nodes = [
        _ray_node(f"node{i}", f"192.168.10.{219 + i}", {}, ["lo", "eth0", "ib0"]) for i in range(3)
    ]
    nodes[0]["env"][var] = value
    report = check_parity(nodes, {**LAUNCH, "launch_env": {}})
    assert report["verdict"] == "blocked"
    (m,) = [m for m in report["mismatches"] if m["field"] == f"env.{var}"]
    assert m["rule_name"] == "comm_set_everywhere"
    assert m["odd_nodes"] == ["node1", "node2"] == m["unset_on"]
    assert m["values"] == {"node0": value, "node1": None, "node2": None}
    assert "unset here but set on node0" in m["problems"]["node2"]
    assert _verdicts(m)["comm_set_everywhere"] == "blocking"


def test_unset_empty_and_not_captured_are_told_apart() -> None:
    """ "" is a value (TP_SOCKET_IFNAME: nothing says tensorpipe ignores it); a name the
    scope covers but the env lacks is unset; a node without env, or a name outside its
    scope, is not captured and never compared."""
    nodes = [
        _ray_node("a", "10.0.0.1", {"TP_SOCKET_IFNAME": ""}, ["lo", "eth0"]),
        _ray_node("b", "10.0.0.2", {}, ["lo", "eth0"]),
        _node("c", "10.0.0.3", env={"NCCL_SOCKET_IFNAME": "eth"}),  # no scope: complete
        _node("d", "10.0.0.4"),
    ]
    del nodes[3]["env"]  # d reported no environment at all
    nodes[2]["interfaces"] = ["lo", "eth0"]
    report = check_parity(nodes, {"launch_env": {}})
    by_field = {m["field"]: m for m in report["mismatches"]}
    tp = by_field["env.TP_SOCKET_IFNAME"]
    assert tp["values"] == {"a": "", "b": None, "c": None}  # d left out
    assert tp["unset_on"] == ["b", "c"] and tp["not_captured_on"] == ["d"]
    assert tp["odd_nodes"] == ["b", "c"]
    # "" names no interface, so none is missing on a; d's value is unknown, so the row
    # cannot say "ok" for every node
    (exists,) = [v for v in tp["rules"] if v["rule"] == "socket_ifname_exists"]
    assert exists["verdict"] == "unknown" and exists["not_captured_on"] == ["d"]
    assert "odd_nodes" not in exists
    assert "d" not in json.dumps(tp["values"])


def test_not_captured_only_is_unknown_not_ok_and_not_blocking() -> None:
    nodes = [
        _ray_node("a", "10.0.0.1", {"TP_SOCKET_IFNAME": "eth0"}, ["lo", "eth0"]),
        # an older probe whose scope did not cover TP_SOCKET_IFNAME
        _node("b", "10.0.0.2", env={}, env_scope={"prefixes": ["NCCL_"], "names": []}),
    ]
    report = check_parity(nodes, {"launch_env": {}})
    # undecided, not ok: the overall verdict says so (the launch is not blocked)
    assert report["verdict"] == "unknown" and report["mismatches"] == []
    unknown = [u for u in report["unknown"] if u["field"] == "env.TP_SOCKET_IFNAME"]
    assert {u["rule"] for u in unknown} >= {"comm_set_everywhere"}
    assert all(u["not_captured_on"] == ["b"] for u in unknown)
    assert any(
        r.startswith("env.TP_SOCKET_IFNAME: comm_set_everywhere undecided")
        and "not captured on b" in r
        for r in report["verdict_reasons"]
    )


# --------------------------------------------------------------------------- launching shell


def _issue_7074_nodes() -> list[dict[str, Any]]:
    """vllm-project/vllm#7074: two nodes, eth0..eth8 on both, Ray started without any
    *_SOCKET_IFNAME: the Ray workers' environment is identical and clean."""
    ifaces = ["lo", *(f"eth{i}" for i in range(9))]
    nodes = [
        _ray_node("node1", "10.41.0.7", {}, ifaces),
        _ray_node("node2", "10.41.0.8", {}, ifaces),
    ]
    for node in nodes:
        node["gpu_count"] = 8  # --tensor-parallel-size 16 over two nodes
    return nodes


SHELL_7074 = {
    "GLOO_SOCKET_IFNAME": "eth0",
    "NCCL_SOCKET_IFNAME": "eth0",
    "TP_SOCKET_IFNAME": "eth0",
}


def test_setting_made_only_in_the_launching_shell_blocks_whatever_else_matches() -> None:
    nodes = _issue_7074_nodes()
    launch = {
        "tensor_parallel_size": 16,
        "launch_env": SHELL_7074,
        "launch_env_source": "the shell of vllm serve on node1",
    }
    report = check_parity(nodes, launch)
    assert report["verdict"] == "blocked"
    fields = sorted(m["field"] for m in report["mismatches"])
    assert fields == [f"env.{v}" for v in sorted(SHELL_7074)]
    for m in report["mismatches"]:
        assert m["rule_name"] == "comm_launch_shell_only"
        assert m["odd_nodes"] == ["node1", "node2"]  # the head's own workers included
        assert m["launch_value"] == "eth0"
        assert m["launch_source"] == "the shell of vllm serve on node1"
        assert "unset in the Ray workers' environment" in m["problems"]["node1"]
        # every other rule is content: the nodes agree with each other
        others = {r: v for r, v in _verdicts(m).items() if r != "comm_launch_shell_only"}
        assert set(others.values()) == {"ok"}
    # the same nodes without the launching environment: nothing to compare, and said so
    report = check_parity(nodes, {"tensor_parallel_size": 16})
    assert report["verdict"] == "ok"
    assert [u["rule"] for u in report["unknown"]] == ["comm_launch_shell_only"]


def test_vllm_host_ip_exported_only_on_the_head_shell_blocks() -> None:
    """VLLM_HOST_IP is in vLLM's WORKER_SPECIFIC_ENV_VARS: never copied to a Ray worker."""
    nodes = _issue_7074_nodes()
    report = check_parity(nodes, {"launch_env": {"VLLM_HOST_IP": "10.41.0.7"}})
    (m,) = report["mismatches"]
    assert m["field"] == "env.VLLM_HOST_IP" and m["odd_nodes"] == ["node1", "node2"]


def test_launch_env_may_come_with_the_head_fingerprint() -> None:
    """vllm-project/vllm#5779: the variables set with os.environ in the driver only."""
    nodes = _issue_7074_nodes()
    nodes[0]["launch_env"] = {"GLOO_SOCKET_IFNAME": "ib0", "TP_SOCKET_IFNAME": "ib0"}
    report = check_parity(nodes)
    assert {m["field"] for m in report["mismatches"]} == {
        "env.GLOO_SOCKET_IFNAME",
        "env.TP_SOCKET_IFNAME",
    }
    assert report["launch_env_source"] == "the launching shell on node1"
    assert "launch_env" not in report["unchecked_fields"]


def test_launching_setting_also_on_every_worker_is_ok() -> None:
    """run_cluster.sh -e on every node: the workers have it (VLLM_HOST_IP their own)."""
    nodes = _issue_7074_nodes()
    for node in nodes:
        node["env"].update(SHELL_7074, VLLM_HOST_IP=node["ip"])
    launch = {"launch_env": {**SHELL_7074, "VLLM_HOST_IP": "10.41.0.7", "HF_HOME": "/hf"}}
    report = check_parity(nodes, launch)
    assert report["verdict"] == "ok", report["mismatches"]
    assert report["unknown"] == [] and report["warnings"] == []


def test_per_node_by_design_variables_may_differ() -> None:
    nodes = _ib_cluster(2)
    for i, node in enumerate(nodes):
        node["env"].update(VLLM_DP_RANK=str(i), VLLM_DP_SIZE="2")
    report = check_parity(nodes, {"launch_env": {}})
    assert report["verdict"] == "ok", report["mismatches"]
    dp = [e for e in report["evaluations"] if e["field"] == "env.VLLM_DP_RANK"]
    assert {e["rule"]: e["verdict"] for e in dp}["per_node_env"] == "ignored"


def test_nccl_ib_pkey_is_compared_not_redacted() -> None:
    assert launch_environment({"NCCL_IB_PKEY": "0x8001", "HF_TOKEN": "hf_x"}) == {
        "HF_TOKEN": "<redacted>",
        "NCCL_IB_PKEY": "0x8001",
    }
    nodes = _ib_cluster(2)
    nodes[0]["env"]["NCCL_IB_PKEY"] = "0x8001"
    nodes[1]["env"]["NCCL_IB_PKEY"] = "0x8002"
    (m,) = check_parity(nodes, {"launch_env": {}})["mismatches"]
    assert m["field"] == "env.NCCL_IB_PKEY" and m["values"]["node1"] == "0x8002"


def test_launch_environment_filter_is_the_fingerprints() -> None:
    assert launcher_fingerprint.FP_ENV_PREFIXES == ENV_PREFIXES
    assert launcher_fingerprint.FP_ENV_NAMES == ENV_NAMES
    sample = {
        "NCCL_SOCKET_IFNAME": "eth0",
        "TP_SOCKET_IFNAME": "eth0",
        "VLLM_API_KEY": "secret",
        "NCCL_IB_PKEY": "0x1",
        "PATH": "/bin",
    }
    assert launch_environment(sample) == launcher_fingerprint.filtered_env(sample)


def test_real_probe_tells_unset_from_set(tmp_path: Path) -> None:
    """Two fingerprints from the real launcher (this venv's python as the engine's):
    one node's Ray workers have TP_SOCKET_IFNAME, the other's do not."""
    with_it = probe_node(sys.executable, None, None, env={"TP_SOCKET_IFNAME": "lo"})
    without = probe_node(sys.executable, None, None)
    assert with_it["env_scope"] == env_scope()
    assert "TP_SOCKET_IFNAME" not in without["env"]
    nodes = [{**with_it, "node": "a"}, {**without, "node": "b"}]
    report = check_parity(nodes, {"launch_env": {}})
    (m,) = [m for m in report["mismatches"] if m["field"] == "env.TP_SOCKET_IFNAME"]
    assert m["odd_nodes"] == ["b"] and m["unset_on"] == ["b"]
    assert "not_captured_on" not in m


def test_orchestrator_environment_is_the_launching_side(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """RayRunBackend.check_nodes: the probe runs with the experiment's env; the
    orchestrator's own environment is compared as the launching side."""
    for name in list(os.environ):
        if any(r.check == "launch_env" for r in rules_for(f"env.{name}")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    seen: dict[str, Any] = {}

    def fake_probe(ids: list[str], *args: Any, **kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        env = {**kwargs["env"]}
        return {i: _ray_node(i, f"10.41.0.{7 + n}", env, ["lo", "eth0"]) for n, i in enumerate(ids)}

    monkeypatch.setattr(backend_module, "probe_on_nodes", fake_probe)
    alive = [{"NodeID": "n1", "Alive": True}, {"NodeID": "n2", "Alive": True}]
    monkeypatch.setattr(backend_module.ray, "nodes", lambda: alive)
    backend = object.__new__(backend_module.RayRunBackend)
    backend.settings = Settings(home=tmp_path, engine=EngineSettings(python=Path(sys.executable)))
    report = backend.check_nodes(
        ["n1", "n2"], model_dir=None, engine_args={}, env={"GLOO_SOCKET_IFNAME": "eth0"}
    )
    assert seen["env"] == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert report["verdict"] == "blocked"
    (m,) = report["mismatches"]
    assert m["field"] == "env.NCCL_SOCKET_IFNAME" and m["rule_name"] == "comm_launch_shell_only"
    assert len(m["odd_nodes"]) == 2 and "orchestrator" in m["launch_source"]
    # the experiment's env reached every node's engine: not a launching-side-only setting
    assert "env.GLOO_SOCKET_IFNAME" not in {x["field"] for x in report["mismatches"]}


def test_launching_side_adds_only_communication_variables() -> None:
    nodes = _issue_7074_nodes()
    launch = {"launch_env": {"TORCH_NCCL_BLOCKING_WAIT": "1", "HF_HOME": "/hf"}}
    report = check_parity(nodes, launch)
    assert report["verdict"] == "ok" and report["unchecked_fields"] == []
    assert not [e for e in report["evaluations"] if e["field"].startswith("env.")]


# --------------------------------------------------------------------------- values read as unset

VLLM_032 = "vLLM 0.32.0"


@pytest.mark.parametrize(
    ("var", "good", "ignored"),
    [
        # NCCL src/misc/socket.cc ncclFindInterfaces: `if (env && strlen(env) > 1)`,
        # else auto-detection (ib* first, then anything but docker/lo)
        ("NCCL_SOCKET_IFNAME", "eth0", ""),
        ("NCCL_SOCKET_IFNAME", "eth0", "e"),
        # torch ProcessGroupGloo.cpp create_default: `ifnameEnv->size() > 1`
        ("GLOO_SOCKET_IFNAME", "eth0", "e"),
        # vLLM 0.32 vllm/envs.py:722 `os.getenv("VLLM_HOST_IP", "")`;
        # vllm/utils/network_utils.py get_ip(): `if host_ip: return host_ip`, else detect
        ("VLLM_HOST_IP", "10.0.0.1", ""),
    ],
)
def test_a_value_the_reader_ignores_blocks_like_an_unset_one(
    var: str, good: str, ignored: str
) -> None:
    """Trial defect 4: eth0 on A and "" on B passed with a warning (or nothing for
    VLLM_HOST_IP), although B then auto-detects exactly as if the variable were unset."""
    nodes = [
        _ray_node("A", "10.0.0.1", {var: good}, ["lo", "eth0"]),
        _ray_node("B", "10.0.0.2", {var: ignored}, ["lo", "eth0"]),
    ]
    report = check_parity(nodes, {"launch_env": {}})
    assert report["verdict"] == "blocked"
    (m,) = report["mismatches"]
    assert m["field"] == f"env.{var}" and m["rule_name"] == "comm_set_everywhere"
    assert m["odd_nodes"] == ["B"] and m["values"]["B"] == ignored
    assert "counts as unset" in m["problems"]["B"] and "but set on A" in m["problems"]["B"]
    assert report["verdict_reasons"] == [f"env.{var}: comm_set_everywhere blocks on B"]
    # the same as when B lacks the variable
    del nodes[1]["env"][var]
    (unset,) = check_parity(nodes, {"launch_env": {}})["mismatches"]
    assert (unset["rule_name"], unset["odd_nodes"]) == ("comm_set_everywhere", ["B"])
    # an ignored value in the workers does not satisfy the launching shell either
    nodes[0]["env"][var] = nodes[1]["env"][var] = ignored
    report = check_parity(nodes, {"launch_env": {var: good}})
    (shell,) = report["mismatches"]
    assert shell["rule_name"] == "comm_launch_shell_only" and shell["odd_nodes"] == ["A", "B"]
    assert "counts as unset" in shell["problems"]["A"]


def test_an_ignored_value_everywhere_is_consistent() -> None:
    """NCCL_SOCKET_IFNAME="" on every node: every node auto-detects alike."""
    nodes = [
        _ray_node(n, ip, {"NCCL_SOCKET_IFNAME": ""}, ["lo", "eth0"])
        for n, ip in (("A", "10.0.0.1"), ("B", "10.0.0.2"))
    ]
    report = check_parity(nodes, {"launch_env": {}})
    assert report["verdict"] == "ok" and report["warnings"] == []


def test_launching_shell_value_other_than_the_workers_warns_naming_the_nodes() -> None:
    """Trial defect 11a: `NCCL_SOCKET_IFNAME=eth0 vllm serve` on the head, `lo` in every
    node's Ray workers. vLLM 0.32's default RayExecutorV2 (ray_executor_v2.py) fills in
    driver variables with setdefault, so the workers' lo is used, not eth0."""
    ifaces = ["lo", "eth0"]
    nodes = [
        _ray_node("A", "10.0.0.1", {"NCCL_SOCKET_IFNAME": "lo"}, ifaces),
        _ray_node("B", "10.0.0.2", {"NCCL_SOCKET_IFNAME": "lo"}, ifaces),
    ]
    launch = {"launch_env": {"NCCL_SOCKET_IFNAME": "eth0"}, "launch_env_source": "the shell"}
    report = check_parity(nodes, launch)
    assert report["verdict"] == "ok" and report["mismatches"] == []
    (w,) = report["warnings"]
    assert w["rule_name"] == "comm_launch_shell_differs" and w["odd_nodes"] == ["A", "B"]
    assert w["launch_value"] == "eth0"
    assert w["problems"]["A"] == (
        "NCCL_SOCKET_IFNAME='lo' in the Ray workers' environment of this node but 'eth0' "
        "in the shell"
    )
    # the same value everywhere: nothing to say
    launch["launch_env"] = {"NCCL_SOCKET_IFNAME": "lo"}
    assert check_parity(nodes, launch)["warnings"] == []


def test_undecided_communication_rule_is_not_ok() -> None:
    """Trial defect 11b: B's probe sent no environment (or a scope without GLOO_): the
    setting A uses cannot be checked on B, so the verdict is "unknown", not "ok"."""
    a = _ray_node("A", "10.0.0.1", {"GLOO_SOCKET_IFNAME": "eth0"}, ["lo", "eth0"])
    no_env = _node("B", "10.0.0.2", interfaces=["lo", "eth0"])
    del no_env["env"]
    narrow = _node("B", "10.0.0.2", env={}, env_scope={"prefixes": ["NCCL_"], "names": []})
    for b in (no_env, narrow):
        report = check_parity([a, b], {"launch_env": {}})
        assert report["verdict"] == "unknown" and report["mismatches"] == []
        assert report["verdict_reasons"]
        assert all(r.startswith("env.GLOO_SOCKET_IFNAME: ") for r in report["verdict_reasons"])
        assert any("comm_set_everywhere undecided" in r for r in report["verdict_reasons"])
    # one node: nothing to compare with, so nothing undecided between nodes
    assert check_parity([a], {"launch_env": {}})["verdict"] == "ok"


@pytest.mark.parametrize("missing", ["absent", "null"])
def test_a_version_not_reported_is_unknown_for_that_node_not_a_mismatch(missing: str) -> None:
    """Trial defect 11c. jobs/launcher/vllm_launcher.py fingerprint: "Unknown values are None"
    (vllm None without a vLLM install, nccl None without CUDA)."""
    nodes = _pair()
    if missing == "absent":
        del nodes[1]["vllm"]
    else:
        nodes[1]["vllm"] = None
    report = check_parity(nodes, {"launch_env": {}})
    assert report["verdict"] == "unknown" and report["mismatches"] == []
    (u,) = [u for u in report["unknown"] if u["field"] == "vllm"]
    assert u["rule"] == "vllm" and u["not_captured_on"] == ["b"]
    assert report["verdict_reasons"] == ["vllm: vllm undecided: vllm was not captured on b"]
    # a real difference among the nodes that report it still blocks
    nodes.append(_node("c", "10.0.0.3", vllm="0.12.0"))
    (m,) = check_parity(nodes, {"launch_env": {}})["mismatches"]
    assert m["field"] == "vllm" and m["odd_nodes"] == ["c"] and "b" not in m["values"]
    # null on every node (a CPU build's nccl): nothing to compare, not evaluated
    for node in nodes:
        node["nccl"] = None
    assert "nccl" not in {e["field"] for e in check_parity(nodes)["evaluations"]}


def test_model_revision_null_is_a_value() -> None:
    """None there means "a directory", not "unknown" (fingerprint --model)."""
    nodes = [
        _by_id("a", "10.0.0.1", SHA_MAIN),
        _by_id("b", "10.0.0.2", None, source="local_dir"),
    ]
    (m,) = [m for m in check_parity(nodes)["mismatches"] if m["field"] == "model_revision"]
    assert m["odd_nodes"] == ["b"] and m["values"]["b"] is None


def test_env_scalars_are_compared_as_strings() -> None:
    """Trial defect 11d: 1 (a JSON number from another producer) vs "1": the process
    environment holds strings only (os.environ), so both are NCCL_IB_DISABLE=1."""
    nodes = [
        _ray_node("A", "10.0.0.1", {"NCCL_IB_DISABLE": 1}, ["lo", "eth0"]),  # type: ignore[dict-item]
        _ray_node("B", "10.0.0.2", {"NCCL_IB_DISABLE": "1"}, ["lo", "eth0"]),
    ]
    report = check_parity(nodes, {"launch_env": {"NCCL_IB_DISABLE": 1}})
    assert report["verdict"] == "ok" and report["warnings"] == []
    nodes[1]["env"]["NCCL_IB_DISABLE"] = "0"
    (m,) = check_parity(nodes, {"launch_env": {}})["mismatches"]
    assert m["rule_name"] == "nccl_same" and m["values"] == {"A": "1", "B": "0"}


def test_upper_case_top_level_keys_are_environment_variables() -> None:
    """Trial defect 11e: a producer writing MASTER_ADDR at the top level (not in env):
    it goes through the env rules instead of landing in unchecked_fields."""
    nodes = [
        _ray_node("A", "10.0.0.1", {}, ["lo", "eth0"]),
        _ray_node("B", "10.0.0.2", {}, ["lo", "eth0"]),
    ]
    nodes[0]["MASTER_ADDR"] = "10.0.0.1"
    report = check_parity(nodes, {"launch_env": {}})
    assert "MASTER_ADDR" not in report["unchecked_fields"]
    (m,) = report["mismatches"]
    assert m["field"] == "env.MASTER_ADDR" and m["odd_nodes"] == ["B"]
    # a node with only top-level variables (no env, no env_scope) tells only about them
    bare = {"node": "C", "ip": "10.0.0.3", "MASTER_ADDR": "10.0.0.1"}
    report = check_parity([nodes[0], bare], {"launch_env": {}})
    env_findings = [m for m in report["mismatches"] if m["field"].startswith("env.")]
    assert env_findings == []
    assert [e["verdict"] for e in report["evaluations"] if e["field"] == "env.MASTER_ADDR"]
    assert {e["verdict"] for e in report["evaluations"] if e["field"] == "env.MASTER_ADDR"} == {
        "ok"
    }


# --- a per-node rule without the node fact it needs (trial of 2026-12-04) -----------------


def _unknowns(report: dict[str, Any], field: str) -> dict[str, dict[str, Any]]:
    return {u["rule"]: u for u in report["unknown"] if u["field"] == field}


def test_socket_ifname_without_the_nodes_interfaces_is_unknown_not_ok() -> None:
    """NCCL_SOCKET_IFNAME=eth9 on both nodes (vllm-project/vllm#44878's shape) but no
    interface list in the fingerprints: whether eth9 exists is unknown, never "ok"."""
    nodes = [_ray_node(n, ip, {"NCCL_SOCKET_IFNAME": "eth9"}, []) for n, ip in _IPS]
    for node in nodes:
        del node["interfaces"]
    report = check_parity(nodes, {"launch_env": {}})
    assert report["verdict"] == "unknown"
    exists = _unknowns(report, "env.NCCL_SOCKET_IFNAME")["socket_ifname_exists"]
    assert set(exists["undecided"]) == {"a", "b"}
    assert "interfaces were not captured" in exists["undecided"]["a"]
    # one node's list is known and lacks eth9: that node blocks, whatever the other says
    nodes[0]["interfaces"] = ["lo", "eth0"]
    report = check_parity(nodes, {"launch_env": {}})
    assert report["verdict"] == "blocked"
    (finding,) = [m for m in report["mismatches"] if m["field"] == "env.NCCL_SOCKET_IFNAME"]
    assert finding["odd_nodes"] == ["a"]


def test_vllm_host_ip_without_the_nodes_ray_ip_is_unknown_not_ok() -> None:
    """vLLM's run_cluster.sh: each node's VLLM_HOST_IP must be its own address; without
    the node's Ray IP in its fingerprint that half of the rule cannot be decided."""
    nodes = [
        _ray_node(n, ip, {"VLLM_HOST_IP": f"10.0.0.{7 + i}"}, ["lo", "eth0"])
        for i, (n, ip) in enumerate(_IPS)
    ]
    for node in nodes:
        del node["ip"]
    report = check_parity(nodes, {"launch_env": {}})
    assert report["verdict"] == "unknown"
    rule = _unknowns(report, "env.VLLM_HOST_IP")["vllm_host_ip"]
    assert "Ray IP was not captured" in rule["undecided"]["b"]


def test_a_socket_ifname_of_two_spaces_is_used_by_nccl() -> None:
    """NCCL tests the raw value (``strlen(env) > 1``, src/misc/socket.cc): two spaces are
    a prefix list that selects no interface, not "ignored"."""
    nodes = [
        _ray_node("a", "10.0.0.1", {"NCCL_SOCKET_IFNAME": "eth0"}, ["eth0"]),
        _ray_node("b", "10.0.0.2", {"NCCL_SOCKET_IFNAME": "  "}, ["eth0"]),
    ]
    report = check_parity(nodes, {"launch_env": {}})
    assert report["verdict"] == "blocked"
    (finding,) = [m for m in report["mismatches"] if m["field"] == "env.NCCL_SOCKET_IFNAME"]
    assert "b" in finding["odd_nodes"]


_IPS = [("a", "10.0.0.1"), ("b", "10.0.0.2")]
