""":mod:`orchestrator.cluster.parity_copy`: where parity finds a setting missing on a node,
it says whether the value the other nodes (or the launching shell) use would work there,
judged on what the node probe captured on that node: its interfaces, Ray IP, GPU count and
engine environment. Each kind of setting with works / does not work / unknown.
"""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.cluster.parity import check_parity
from orchestrator.cluster.parity_copy import judge_copy
from web.pages.run import parity_rows

SCOPE = {
    "prefixes": ["NCCL_", "GLOO_", "VLLM_", "HF_", "UCX_", "TORCH_"],
    "names": ["CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"]
    + ["TP_SOCKET_IFNAME"],
}
#: The facts the node probe reports, as ``unknown`` leaves them out.
FACTS = {"interfaces": ["lo", "eth0"], "gpu_count": 2}


def _node(name: str, ip: str | None, env: dict[str, str], **facts: Any) -> dict[str, Any]:
    node: dict[str, Any] = {"node": name, "env": env, "env_scope": SCOPE, **facts}
    if ip is not None:
        node["ip"] = ip
    return node


def _target(kind: str) -> dict[str, Any]:
    """The node that lacks the setting: its facts as captured, or none captured."""
    if kind == "unknown":
        return _node("b", None, {})
    return _node("b", "10.0.0.2", {}, **FACTS)


def _finding(report: dict[str, Any], field: str) -> dict[str, Any]:
    (f,) = [f for f in [*report["mismatches"], *report["warnings"]] if f["field"] == field]
    return f


# (variable, the value set on node a, the verdict on b: works / does not work / unknown)
CASES = [
    ("NCCL_SOCKET_IFNAME", "eth", "works", "it selects ['eth0'] among this node's interfaces"),
    ("NCCL_SOCKET_IFNAME", "ib", "does_not_work", "it selects none of this node's interfaces"),
    ("NCCL_SOCKET_IFNAME", "^lo", "works", "it selects ['eth0']"),
    ("GLOO_SOCKET_IFNAME", "eth0", "works", "it selects ['eth0']"),
    ("GLOO_SOCKET_IFNAME", "eth9", "does_not_work", "eth9 is not among this node's interfaces"),
    ("TP_SOCKET_IFNAME", "eth0,eth9", "does_not_work", "eth9 is not among"),
    ("CUDA_VISIBLE_DEVICES", "0,1", "works", "device(s) 0, 1 exist among this node's 2 GPU(s)"),
    ("CUDA_VISIBLE_DEVICES", "0,3", "does_not_work", "device(s) 3 not among this node's 2"),
    ("UCX_NET_DEVICES", "eth0", "works", "['eth0'] are among this node's interfaces"),
    ("UCX_NET_DEVICES", "eth9", "does_not_work", "['eth9'] not among this node's interfaces"),
    ("NCCL_IB_DISABLE", "1", "not_node_specific", "nothing on this node to check"),
    ("MASTER_PORT", "29500", "not_node_specific", "copying it makes the nodes agree"),
]


@pytest.mark.parametrize(("var", "value", "verdict", "reason"), CASES)
def test_a_missing_setting_says_whether_the_other_nodes_value_works_here(
    var: str, value: str, verdict: str, reason: str
) -> None:
    nodes = [_node("a", "10.0.0.1", {var: value}, **{**FACTS, "gpu_count": 4})]
    nodes.append(_target("captured"))
    report = check_parity(nodes, {"launch_env": {}})
    f = _finding(report, f"env.{var}")
    assert f["unset_on"] == ["b"]
    (item,) = f["copy_check"]["b"]
    assert (item["value"], item["set_on"], item["verdict"]) == (value, ["a"], verdict)
    assert reason in item["reason"] and item["reason"] in item["message"]
    assert item["message"].startswith(
        f"whether copying {var}={value!r}" if verdict == "unknown" else f"copying {var}={value!r}"
    )
    # the message of the finding says it too, on the node that lacks the setting (the
    # odd one out of two: the first node breaks ties)
    assert item["message"] in f["problems"]["b"]
    assert "a" not in f["copy_check"]


@pytest.mark.parametrize(
    ("var", "value", "reason"),
    [
        ("NCCL_SOCKET_IFNAME", "eth", "this node's network interfaces were not captured"),
        ("GLOO_SOCKET_IFNAME", "eth0", "this node's network interfaces were not captured"),
        ("UCX_NET_DEVICES", "eth0", "this node's network interfaces were not captured"),
        ("VLLM_HOST_IP", "10.0.0.2", "this node's Ray IP was not captured"),
    ],
)
def test_a_fact_not_captured_on_the_node_gives_unknown(var: str, value: str, reason: str) -> None:
    """The launching shell sets it, no node's Ray workers do, and node b reported no
    interfaces, GPU count or IP: for b the answer is unknown, never guessed."""
    nodes = [_node("a", "10.0.0.1", {}, **FACTS), _target("unknown")]
    report = check_parity(nodes, {"launch_env": {var: value}, "launch_env_source": "the shell"})
    f = _finding(report, f"env.{var}")
    assert f["rule_name"] == "comm_launch_shell_only" and f["odd_nodes"] == ["a", "b"]
    (item,) = f["copy_check"]["b"]
    assert (item["verdict"], item["set_on"], item["launch_source"]) == ("unknown", [], "the shell")
    assert reason in item["reason"]
    assert item["message"].startswith(f"whether copying {var}={value!r} (set in the shell)")
    assert item["message"] in f["problems"]["b"]
    assert f["copy_check"]["a"][0]["verdict"] != "unknown"  # a's facts were captured


def test_the_ip_of_another_node_never_works_and_the_nodes_own_does() -> None:
    """VLLM_HOST_IP is per node: a's address copied to b duplicates it; the launching
    shell's value works on the node whose Ray IP it is, on no other."""
    nodes = [_node("a", "10.0.0.1", {"VLLM_HOST_IP": "10.0.0.1"}, **FACTS), _target("captured")]
    f = _finding(check_parity(nodes, {"launch_env": {}}), "env.VLLM_HOST_IP")
    (item,) = f["copy_check"]["b"]
    assert item["verdict"] == "does_not_work"
    assert "10.0.0.1 is a's: a copy gives two nodes one address" in item["reason"]
    assert "set this node's Ray IP 10.0.0.2 here" in item["reason"]
    # another node's address is a duplicate whatever this node's IP: known without it
    nodes[1] = _target("unknown")
    f = _finding(check_parity(nodes, {"launch_env": {}}), "env.VLLM_HOST_IP")
    (item,) = f["copy_check"]["b"]
    assert item["verdict"] == "does_not_work"
    assert "(this node's Ray IP was not captured)" in item["reason"]
    shell = {"launch_env": {"VLLM_HOST_IP": "10.0.0.2"}, "launch_env_source": "the shell on b"}
    nodes = [_node("a", "10.0.0.1", {}, **FACTS), _target("captured")]
    f = _finding(check_parity(nodes, shell), "env.VLLM_HOST_IP")
    assert f["rule_name"] == "comm_launch_shell_only"
    assert [i["verdict"] for i in f["copy_check"]["b"]] == ["works"]
    assert [i["verdict"] for i in f["copy_check"]["a"]] == ["does_not_work"]
    assert "is not this node's Ray IP 10.0.0.1; set 10.0.0.1 here" in f["problems"]["a"]
    assert "(set in the shell on b) would work here" in f["problems"]["b"]


def test_several_values_are_each_judged_and_ignored_ones_are_not_offered() -> None:
    """eth0 on a, ens5 on c, "e" (NCCL ignores it) on d, nothing on b: b is told that
    copying a's value works and c's does not; d's ignored value is no candidate."""
    nodes = [
        _node("a", "10.0.0.1", {"NCCL_SOCKET_IFNAME": "eth0"}, interfaces=["lo", "eth0"]),
        _node("b", "10.0.0.2", {}, interfaces=["lo", "eth0"]),
        _node("c", "10.0.0.3", {"NCCL_SOCKET_IFNAME": "ens5"}, interfaces=["lo", "ens5"]),
        _node("d", "10.0.0.4", {"NCCL_SOCKET_IFNAME": "e"}, interfaces=["lo", "ens5"]),
    ]
    f = _finding(check_parity(nodes, {"launch_env": {}}), "env.NCCL_SOCKET_IFNAME")
    assert f["odd_nodes"] == ["b", "d"]
    by_value = {i["value"]: i["verdict"] for i in f["copy_check"]["b"]}
    assert by_value == {"eth0": "works", "ens5": "does_not_work"}
    assert {i["value"]: i["verdict"] for i in f["copy_check"]["d"]} == {
        "eth0": "does_not_work",
        "ens5": "works",
    }
    assert "NCCL ignores a NCCL_SOCKET_IFNAME under 2 characters" in f["problems"]["d"]
    assert "copying NCCL_SOCKET_IFNAME='ens5' (set on c) would work here" in f["problems"]["d"]


def _engine(python: str, ok: bool, source: str = "VLAB_ENGINE__PYTHON") -> dict[str, Any]:
    return {
        "kind": "path",
        "python": python,
        "source": source,
        "exists": ok,
        "is_file": ok or None,
        "executable": ok,
    }


def test_the_engine_python_other_nodes_use_is_judged_on_what_the_node_checked() -> None:
    """Node b's probe checked the very path a uses and found nothing: copying does not
    work; c's probe checked another path (its own setting): whether a's exists there is
    unknown. (A path the probe did not check is never said to work.)"""
    nodes = [
        {"node": "a", "ip": "10.0.0.1", "engine_env": _engine("/opt/vllm/bin/python", True)},
        {"node": "b", "ip": "10.0.0.2", "engine_env": _engine("/opt/vllm/bin/python", False)},
        {
            "node": "c",
            "ip": "10.0.0.3",
            "engine_env": _engine(
                "/srv/vllm/bin/python", False, "VLAB_ENGINE__PYTHON_BY_NODE[10.0.0.3]"
            ),
        },
    ]
    f = _finding(check_parity(nodes, {"launch_env": {}}), "engine_env")
    (b,) = f["copy_check"]["b"]
    (c,) = f["copy_check"]["c"]
    assert (b["value"], b["set_on"], b["verdict"]) == (
        "/opt/vllm/bin/python",
        ["a"],
        "does_not_work",
    )
    assert (
        c["verdict"] == "unknown"
        and "checked only its own python /srv/vllm/bin/python" in (c["reason"])
    )
    assert (
        "using the engine python /opt/vllm/bin/python (used on a) would not work"
        in (f["problems"]["b"])
    )
    assert f["problems"]["b"].startswith("engine python /opt/vllm/bin/python does not exist")


def test_cuda_devices_not_counted_by_uuid_or_empty() -> None:
    nodes = [_node("a", "10.0.0.1", {"CUDA_VISIBLE_DEVICES": "0"}, **FACTS), _target("unknown")]
    f = _finding(check_parity(nodes, {"launch_env": {}}), "env.CUDA_VISIBLE_DEVICES")
    (item,) = f["copy_check"]["b"]
    assert item["verdict"] == "unknown" and "this node's GPUs were not counted" in item["reason"]
    assert item["message"] in f["problems"]["b"]  # the odd one of two (ties: the first's)
    node = {"gpu_count": 2}
    assert judge_copy("CUDA_VISIBLE_DEVICES", "GPU-8a6d1c2e", node)[0] == "unknown"
    assert judge_copy("CUDA_VISIBLE_DEVICES", "", node) == (
        "does_not_work",
        "an empty list hides all 2 GPUs of this node",
    )
    assert judge_copy("CUDA_VISIBLE_DEVICES", "", {"gpu_count": 0})[0] == "works"
    assert judge_copy("NCCL_IB_HCA", "mlx5_0", FACTS)[0] == "unknown"
    assert judge_copy("UCX_NET_DEVICES", "mlx5_0:1", FACTS)[0] == "unknown"
    assert judge_copy("VLLM_NCCL_SO_PATH", "/opt/nccl/libnccl.so.2", FACTS)[0] == "unknown"
    assert judge_copy("VLLM_DP_RANK", "0", FACTS, ["a"])[0] == "does_not_work"


def test_majority_without_the_setting_gets_the_copy_check_and_the_page_shows_it() -> None:
    """CUDA_VISIBLE_DEVICES set on a only, of three: a is the odd one out (identical
    rule), b and c lack it without a problem of their own; the copy check is still
    there, and the run page's parity table shows it in their cells."""
    nodes = [
        _node("a", "10.0.0.1", {"CUDA_VISIBLE_DEVICES": "0,3"}, gpu_count=4),
        _node("b", "10.0.0.2", {}, gpu_count=4),
        _node("c", "10.0.0.3", {}, gpu_count=2),
    ]
    report = check_parity(nodes, {"launch_env": {}})
    f = _finding(report, "env.CUDA_VISIBLE_DEVICES")
    assert f["odd_nodes"] == ["a"] and "b" not in f.get("problems", {})
    assert [i["verdict"] for i in f["copy_check"]["b"]] == ["works"]
    assert [i["verdict"] for i in f["copy_check"]["c"]] == ["does_not_work"]
    (row,) = [r for r in parity_rows(report) if r.field == "env.CUDA_VISIBLE_DEVICES"]
    assert row.copies["c"] == f["copy_check"]["c"][0]["message"]
    assert "device(s) 3 not among this node's 2 GPU(s)" in row.copies["c"]
    assert "a" not in row.copies
