"""Tests for orchestrator.cluster.placement: node choice, ranks, stages, bundles, refusals."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.cluster.placement import (
    NodeAssignment,
    NodeInventory,
    Placement,
    cpu_thread_binding,
    nodes_from_ray,
    plan_placement,
    shape_problem,
)


def node(n: int, total: int, available: int | None = None, *, alive: bool = True) -> NodeInventory:
    """Node ``n`` with id ``node-<n>`` and IP ``10.0.0.<n>``."""
    return NodeInventory(
        node_id=f"node-{n:02d}",
        ip=f"10.0.0.{n}",
        total=total,
        available=total if available is None else available,
        alive=alive,
    )


# --------------------------------------------------------------------------- single node


def test_single_node_fit() -> None:
    placement = plan_placement([node(1, 8)], tp=2, pp=2)
    assert placement is not None
    assert placement.nnodes == 1
    (only,) = placement.nodes
    assert only == NodeAssignment("node-01", "10.0.0.1", 0, (0, 1), 4, 4)
    assert placement.devices == 4
    assert placement.bundles("GPU") == [{"GPU": 1.0, "node:10.0.0.1": 0.001}] * 4
    assert placement.bundle_node_index() == [0, 0, 0, 0]


def test_prefers_one_node_over_several() -> None:
    nodes = [node(1, 2), node(2, 2), node(3, 4)]
    placement = plan_placement(nodes, tp=1, pp=4)
    assert placement is not None
    assert [a.node_id for a in placement.nodes] == ["node-03"]
    assert placement.nodes[0].stages == (0, 1, 2, 3)


def test_extra_devices_on_one_node() -> None:
    placement = plan_placement([node(1, 4), node(2, 8)], tp=2, pp=1, devices=6)
    assert placement is not None
    assert [(a.node_id, a.devices, a.reserved) for a in placement.nodes] == [("node-02", 6, 6)]
    assert len(placement.bundles("CPU")) == 6


def test_extra_devices_never_multi_node() -> None:
    nodes = [node(1, 4), node(2, 4)]
    reason = shape_problem(nodes, tp=2, pp=2, devices=6, resource="CPU")
    assert reason is not None
    assert "only supported on one node" in reason
    assert "6 CPU devices" in reason and "largest node has 4" in reason
    assert plan_placement(nodes, tp=2, pp=2, devices=6) is None
    # Without the extra devices the same shape splits over the two nodes.
    assert shape_problem(nodes, tp=2, pp=2) is None
    assert plan_placement(nodes, tp=2, pp=2) is not None


# --------------------------------------------------------------------------- refusals


def test_tp_too_large_refused_with_numbers() -> None:
    nodes = [node(1, 2), node(2, 2), node(3, 2)]
    reason = shape_problem(nodes, tp=4, pp=1, resource="CPU")
    assert reason == (
        "tensor_parallel_size 4 needs 4 CPU devices in one node; the largest node has 2"
    )
    assert plan_placement(nodes, tp=4, pp=1) is None


def test_too_many_devices_for_cluster() -> None:
    reason = shape_problem([node(1, 2), node(2, 2)], tp=1, pp=8, resource="GPU")
    assert reason is not None
    assert "8 GPU devices" in reason and "4 in total" in reason


def test_uneven_split_refused() -> None:
    # PP=3, TP=1 over two 2-device nodes: 1 node needs 3, 3 nodes x 1 needs three nodes.
    nodes = [node(1, 2), node(2, 2)]
    reason = shape_problem(nodes, tp=1, pp=3)
    assert reason is not None
    assert "1 node x 3 devices (the largest node has 2)" in reason
    assert "3 nodes x 1 device (only 2 nodes with 1 or more)" in reason
    assert plan_placement(nodes, tp=1, pp=3) is None
    # A third node makes 3 nodes x 1 stage possible.
    three = [*nodes, node(3, 2)]
    assert shape_problem(three, tp=1, pp=3) is None
    placement = plan_placement(three, tp=1, pp=3)
    assert placement is not None
    assert [a.stages for a in placement.nodes] == [(0,), (1,), (2,)]


def test_dead_nodes_do_not_count() -> None:
    nodes = [node(1, 2), node(2, 8, alive=False)]
    assert shape_problem(nodes, tp=4, pp=1) is not None
    assert plan_placement(nodes, tp=4, pp=1) is None
    assert shape_problem([node(1, 2, alive=False)], tp=1, pp=1) is not None


@pytest.mark.parametrize(("tp", "pp", "devices"), [(0, 1, None), (1, 0, None), (2, 2, 3)])
def test_bad_arguments_raise(tp: int, pp: int, devices: int | None) -> None:
    with pytest.raises(ValueError):
        plan_placement([node(1, 8)], tp, pp, devices=devices)
    with pytest.raises(ValueError):
        shape_problem([node(1, 8)], tp, pp, devices)


def test_inventory_validates_counts() -> None:
    with pytest.raises(ValueError):
        NodeInventory("n", "10.0.0.1", total=2, available=3)
    with pytest.raises(ValueError):
        NodeInventory("n", "10.0.0.1", total=-1, available=0)


# --------------------------------------------------------------------------- multi node


def test_pp2_tp2_over_two_2_device_nodes() -> None:
    nodes = [node(2, 2), node(1, 2)]
    placement = plan_placement(nodes, tp=2, pp=2)
    assert placement is not None
    assert placement.nnodes == 2
    assert [(a.rank, a.node_id, a.stages, a.devices) for a in placement.nodes] == [
        (0, "node-01", (0,), 2),
        (1, "node-02", (1,), 2),
    ]
    assert placement.bundle_node_index() == [0, 0, 1, 1]
    assert placement.bundles("CPU") == [
        {"CPU": 1.0, "node:10.0.0.1": 0.001},
        {"CPU": 1.0, "node:10.0.0.1": 0.001},
        {"CPU": 1.0, "node:10.0.0.2": 0.001},
        {"CPU": 1.0, "node:10.0.0.2": 0.001},
    ]


def test_ranks_sort_ips_numerically() -> None:
    nodes = [node(10, 1), node(9, 1)]
    placement = plan_placement(nodes, tp=1, pp=2)
    assert placement is not None
    assert [a.ip for a in placement.nodes] == ["10.0.0.9", "10.0.0.10"]


def test_busy_cluster_returns_none_but_shape_is_fine() -> None:
    nodes = [node(1, 2, available=1), node(2, 2, available=0)]
    assert shape_problem(nodes, tp=2, pp=2) is None
    assert plan_placement(nodes, tp=2, pp=2) is None


def test_best_fit_takes_the_smallest_node_that_fits() -> None:
    nodes = [node(1, 8), node(2, 4, available=3), node(3, 4, available=2), node(4, 2, 1)]
    placement = plan_placement(nodes, tp=2, pp=1)
    assert placement is not None
    assert [a.node_id for a in placement.nodes] == ["node-03"]


def test_best_fit_ties_broken_by_node_id() -> None:
    nodes = [node(5, 4), node(3, 4), node(7, 4), node(1, 16)]
    placement = plan_placement(nodes, tp=1, pp=2)
    assert placement is not None
    assert [a.node_id for a in placement.nodes] == ["node-03"]


def test_multi_node_best_fit() -> None:
    # No node has 8 available; two nodes with 4 are needed: take the tightest fits.
    nodes = [node(1, 8, 7), node(2, 8, 4), node(3, 8, 5), node(4, 8, 4), node(5, 8, 3)]
    placement = plan_placement(nodes, tp=4, pp=2)
    assert placement is not None
    assert [a.node_id for a in placement.nodes] == ["node-02", "node-04"]
    assert [a.stages for a in placement.nodes] == [(0,), (1,)]


def test_exclusive_takes_only_idle_nodes_and_reserves_everything() -> None:
    nodes = [node(1, 4, available=3), node(2, 4), node(3, 8), node(4, 4)]
    placement = plan_placement(nodes, tp=2, pp=2, exclusive=True)
    assert placement is not None
    assert [a.node_id for a in placement.nodes] == ["node-02"]
    assert placement.nodes[0].devices == 4 and placement.nodes[0].reserved == 4

    spread = plan_placement(nodes, tp=2, pp=4, exclusive=True)
    assert spread is not None
    # 8 devices: node-03 is idle with 8, a single node beats two.
    assert [a.node_id for a in spread.nodes] == ["node-03"]

    two = plan_placement(nodes, tp=1, pp=2, exclusive=True)
    assert two is not None
    assert [(a.node_id, a.devices, a.reserved) for a in two.nodes] == [("node-02", 2, 4)]
    assert len(two.bundles("GPU")) == 4
    assert two.bundle_node_index() == [0, 0, 0, 0]


def test_exclusive_multi_node_bundle_count_is_sum_of_totals() -> None:
    nodes = [node(1, 3), node(2, 3), node(3, 4, available=2)]
    # node-03 could host all 4 devices if it were idle; exclusive skips it.
    placement = plan_placement(nodes, tp=2, pp=2, exclusive=True)
    assert placement is not None
    assert placement.nnodes == 2
    assert [a.node_id for a in placement.nodes] == ["node-01", "node-02"]
    assert all(a.devices == 2 and a.reserved == 3 for a in placement.nodes)
    bundles = placement.bundles("CPU")
    assert len(bundles) == 3 + 3 == placement.reserved
    assert placement.devices == 4
    assert placement.bundle_node_index() == [0, 0, 0, 1, 1, 1]
    assert sum(1 for b in bundles if "node:10.0.0.2" in b) == 3
    # Three nodes x 2 devices: the busy node-03 is no candidate when exclusive.
    assert plan_placement(nodes, tp=2, pp=3, exclusive=True) is None
    shared = plan_placement(nodes, tp=2, pp=3)
    assert shared is not None
    assert shared.nnodes == 3


def test_layout_doc_is_json_safe() -> None:
    placement = plan_placement([node(1, 2), node(2, 4, 2)], tp=2, pp=2, exclusive=False)
    assert placement is not None
    doc = placement.layout_doc()
    assert json.loads(json.dumps(doc)) == doc
    assert doc == {
        "nodes": [
            {
                "node_id": "node-01",
                "ip": "10.0.0.1",
                "rank": 0,
                "stages": [0],
                "devices": 2,
                "reserved": 2,
            },
            {
                "node_id": "node-02",
                "ip": "10.0.0.2",
                "rank": 1,
                "stages": [1],
                "devices": 2,
                "reserved": 2,
            },
        ],
        "exclusive": False,
        "policy": "shared_nodes",
        "nnodes": 2,
    }
    exclusive = plan_placement([node(1, 4)], tp=1, pp=1, exclusive=True)
    assert exclusive is not None
    assert exclusive.layout_doc()["policy"] == "exclusive_nodes"
    assert exclusive.layout_doc()["nodes"][0]["reserved"] == 4


def test_deterministic_under_shuffling() -> None:
    nodes = [
        node(i, total, available)
        for i, (total, available) in enumerate(
            [(4, 2), (4, 2), (8, 2), (2, 2), (4, 4), (2, 1), (8, 8), (2, 2)], start=1
        )
    ]
    rng = random.Random(7)
    for tp, pp, exclusive in [(1, 4, False), (2, 1, False), (2, 4, True), (1, 2, True)]:
        first = plan_placement(nodes, tp, pp, exclusive=exclusive)
        assert first is not None
        assert plan_placement(nodes, tp, pp, exclusive=exclusive) == first
        for _ in range(10):
            shuffled = nodes[:]
            rng.shuffle(shuffled)
            assert plan_placement(shuffled, tp, pp, exclusive=exclusive) == first


# --------------------------------------------------------------------------- ray input


def _ray_node(
    node_id: str, ip: str, resources: dict[str, float], *, alive: bool = True
) -> dict[str, Any]:
    """A ``ray.nodes()`` entry with the key names Ray 2.x returns."""
    return {
        "NodeID": node_id,
        "Alive": alive,
        "NodeManagerAddress": ip,
        "NodeManagerHostname": f"host-{ip}",
        "NodeManagerPort": 40123,
        "ObjectManagerPort": 40124,
        "ObjectStoreSocketName": "/tmp/ray/session_x/sockets/plasma_store",
        "RayletSocketName": "/tmp/ray/session_x/sockets/raylet",
        "MetricsExportPort": 61234,
        "NodeName": ip,
        "RuntimeEnvAgentPort": 59876,
        "DeathReason": 0 if alive else 1,
        "DeathReasonMessage": "" if alive else "node died",
        "alive": alive,
        "Resources": resources,
        "Labels": {"ray.io/node-id": node_id},
    }


RAY_NODES = [
    _ray_node(
        "a1" * 28,
        "10.0.0.1",
        {
            "CPU": 2.0,
            "node:10.0.0.1": 1.0,
            "node:__internal_head__": 1.0,
            "memory": 4_294_967_296.0,
            "object_store_memory": 1_073_741_824.0,
        },
    ),
    _ray_node(
        "b2" * 28,
        "10.0.0.2",
        {"CPU": 4.0, "GPU": 2.0, "node:10.0.0.2": 1.0, "memory": 8_589_934_592.0},
    ),
    _ray_node("c3" * 28, "10.0.0.3", {"CPU": 8.0, "node:10.0.0.3": 1.0}, alive=False),
    _ray_node("d4" * 28, "10.0.0.4", {"CPU": 2.5, "node:10.0.0.4": 1.0, "memory": 1.0}),
    _ray_node("e5" * 28, "10.0.0.5", {"CPU": 0.5, "node:10.0.0.5": 1.0}),
]


def test_nodes_from_ray_without_availability() -> None:
    inventories = nodes_from_ray(RAY_NODES, None, "CPU")
    assert [(n.node_id[:2], n.ip, n.total, n.available) for n in inventories] == [
        ("a1", "10.0.0.1", 2, 2),
        ("b2", "10.0.0.2", 4, 4),
        ("d4", "10.0.0.4", 2, 2),
    ]
    assert all(n.alive for n in inventories)
    assert inventories[0].labels == {"ray.io/node-id": "a1" * 28}


def test_nodes_from_ray_with_availability() -> None:
    available = {
        "a1" * 28: {"CPU": 1.5, "memory": 1.0},
        "b2" * 28: {"CPU": 4.0, "GPU": 1.0},
        # d4 missing: nothing known to be free there.
    }
    cpu = nodes_from_ray(RAY_NODES, available, "CPU")
    assert [(n.ip, n.total, n.available) for n in cpu] == [
        ("10.0.0.1", 2, 1),
        ("10.0.0.2", 4, 4),
        ("10.0.0.4", 2, 0),
    ]
    gpu = nodes_from_ray(RAY_NODES, available, "GPU")
    assert [(n.ip, n.total, n.available) for n in gpu] == [("10.0.0.2", 2, 1)]


def test_nodes_from_ray_feeds_the_planner() -> None:
    inventories = nodes_from_ray(RAY_NODES, None, "CPU")
    placement = plan_placement(inventories, tp=2, pp=2)
    assert placement is not None
    assert [a.ip for a in placement.nodes] == ["10.0.0.2"]
    assert placement.bundles("CPU")[0] == {"CPU": 1.0, "node:10.0.0.2": 0.001}
    reason = shape_problem(inventories, tp=8, pp=1, resource="CPU")
    assert reason == (
        "tensor_parallel_size 8 needs 8 CPU devices in one node; the largest node has 4"
    )


# --------------------------------------------------------------------------- properties


@st.composite
def clusters(draw: st.DrawFn) -> list[NodeInventory]:
    count = draw(st.integers(min_value=1, max_value=6))
    out = []
    for i in range(count):
        total = draw(st.integers(min_value=1, max_value=8))
        available = draw(st.integers(min_value=0, max_value=total))
        alive = draw(st.booleans()) if i else True
        out.append(
            NodeInventory(
                f"n{i}", f"10.0.{i % 3}.{i}", total=total, available=available, alive=alive
            )
        )
    return out


def _idle(nodes: list[NodeInventory]) -> list[NodeInventory]:
    return [
        NodeInventory(n.node_id, n.ip, total=n.total, available=n.total, alive=n.alive)
        for n in nodes
    ]


def _check(
    placement: Placement, nodes: list[NodeInventory], tp: int, pp: int, devices: int | None
) -> None:
    by_id = {n.node_id: n for n in nodes}
    assert (placement.tp, placement.pp) == (tp, pp)
    assert [a.rank for a in placement.nodes] == list(range(placement.nnodes))
    assert len({a.node_id for a in placement.nodes}) == placement.nnodes
    stage_counts = {len(a.stages) for a in placement.nodes}
    assert len(stage_counts) == 1
    assert [s for a in placement.nodes for s in a.stages] == list(range(pp))
    if devices is not None and devices > tp * pp:
        assert placement.nnodes == 1
        assert placement.devices == devices
    else:
        assert all(a.devices == tp * len(a.stages) for a in placement.nodes)
        assert placement.devices == tp * pp
    for a in placement.nodes:
        inv = by_id[a.node_id]
        assert inv.alive
        assert a.devices <= a.reserved <= inv.available
        assert a.ip == inv.ip
    bundles = placement.bundles("GPU")
    assert len(bundles) == len(placement.bundle_node_index()) == placement.reserved
    for bundle, rank in zip(bundles, placement.bundle_node_index(), strict=True):
        assert bundle == {"GPU": 1.0, f"node:{placement.nodes[rank].ip}": 0.001}


@settings(max_examples=300, deadline=None)
@given(
    nodes=clusters(),
    tp=st.integers(min_value=1, max_value=8),
    pp=st.integers(min_value=1, max_value=8),
    extra=st.one_of(st.none(), st.integers(min_value=0, max_value=3)),
    exclusive=st.booleans(),
)
def test_placement_properties(
    nodes: list[NodeInventory], tp: int, pp: int, extra: int | None, exclusive: bool
) -> None:
    devices = None if extra is None else tp * pp + extra
    problem = shape_problem(nodes, tp, pp, devices)
    placement = plan_placement(nodes, tp, pp, devices=devices, exclusive=exclusive)
    if problem is not None:
        assert placement is None
    if placement is not None:
        _check(placement, nodes, tp, pp, devices)
        by_id = {n.node_id: n for n in nodes}
        if exclusive:
            assert all(by_id[a.node_id].idle for a in placement.nodes)
            assert all(a.reserved == by_id[a.node_id].total for a in placement.nodes)
        else:
            assert placement.reserved == placement.devices
            if not extra:
                assert placement.devices == tp * pp
    # Whenever the shape can fit, an idle cluster places it.
    idle = _idle(nodes)
    idle_placement = plan_placement(idle, tp, pp, devices=devices, exclusive=exclusive)
    assert (idle_placement is not None) == (problem is None)
    if idle_placement is not None:
        _check(idle_placement, idle, tp, pp, devices)


def test_gpu_node_bundles_hold_each_nodes_devices_in_one_bundle() -> None:
    from orchestrator.cluster.placement import NodeInventory, plan_placement

    nodes = [NodeInventory(f"n{i}", f"10.0.0.{i + 1}", total=2, available=2) for i in range(2)]
    plan = plan_placement(nodes, 2, 2)
    assert plan is not None
    assert plan.node_bundles("GPU") == [
        {"GPU": 2.0, "node:10.0.0.1": 0.001},
        {"GPU": 2.0, "node:10.0.0.2": 0.001},
    ]
    exclusive = plan_placement(
        [NodeInventory("n0", "10.0.0.1", total=8, available=8)], 2, 1, exclusive=True
    )
    assert exclusive is not None
    assert exclusive.node_bundles("GPU") == [{"GPU": 8.0, "node:10.0.0.1": 0.001}]


def test_device_kind_is_detected_unless_set() -> None:
    from orchestrator.core.settings import detect_device_resource

    assert detect_device_resource("auto", {"CPU": 16.0, "GPU": 8.0}) == ("GPU", "detected")
    assert detect_device_resource("auto", {"CPU": 16.0, "GPU": 0.5}) == ("CPU", "detected")
    assert detect_device_resource("auto", {"CPU": 2.0}) == ("CPU", "detected")
    assert detect_device_resource("CPU", {"GPU": 8.0}) == ("CPU", "setting")
    assert detect_device_resource("GPU", {}) == ("GPU", "setting")


def test_cpu_thread_binding_splits_devices_over_ranks() -> None:
    assert cpu_thread_binding({"tensor_parallel_size": 2, "pipeline_parallel_size": 1}) == "0|1"
    assert cpu_thread_binding({"tensor_parallel_size": 1, "devices": 2}) == "0-1"
    assert cpu_thread_binding({"tensor_parallel_size": 1}) == "0"
    assert (
        cpu_thread_binding({"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "devices": 8})
        == "0-1|2-3|4-5|6-7"
    )
