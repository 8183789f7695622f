"""Multi-node placement of one vLLM run: which nodes, which pipeline stages, which bundles.

Pure functions and frozen dataclasses: no Ray import, no I/O, so both the
dispatcher and the API can call them. The Ray-facing code fetches
``ray.nodes()`` and the per-node available resources and passes them to
:func:`nodes_from_ray`.

Units: a *device* is one unit of the configured Ray resource -- a GPU on GPU
clusters, a CPU core on CPU hosts (resource name ``"GPU"`` or ``"CPU"``). All
counts are whole devices (``int``).

vLLM's multi-node layout, which the planner follows:

- each tensor-parallel group sits inside one node (TP runs over NVLink / shared
  memory), pipeline-parallel stages may span nodes;
- a run on ``N`` nodes launches one vLLM process per node
  (``--nnodes N --node-rank r``) and the multi-process backend puts
  ``TP * PP / N`` ranks on every node, so ``N`` divides ``PP`` and every chosen
  node hosts the same number ``PP / N`` of whole, consecutive stages: node rank
  ``r`` hosts stages ``r * PP/N .. (r + 1) * PP/N - 1`` (stage 0 on rank 0).

Bundles pin to nodes with Ray's per-node resource ``node:<ip>`` (every raylet
advertises ``node:<its ip>: 1.0``), the same way vLLM pins its first bundle
(``vllm/executor/ray_utils.py``, ``initialize_ray_cluster``:
``placement_group_specs[0][f"node:{current_ip}"] = 0.001``).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

NODE_RESOURCE_PREFIX = "node:"
"""Prefix of Ray's per-node resource: ``node:<ip>`` is ``1.0`` on the node with that IP."""

NODE_AFFINITY_AMOUNT = 0.001
"""Amount of ``node:<ip>`` each bundle asks for (as vLLM does); at most 1000 bundles per node."""

_FLOOR_EPSILON = 1e-6


# --------------------------------------------------------------------------- inventory


@dataclass(frozen=True)
class NodeInventory:
    """One live Ray node as seen by the planner.

    Attributes:
        node_id: Ray node id (hex string, ``ray.nodes()[i]["NodeID"]``).
        ip: node IP (``NodeManagerAddress``); bundles pin to it through ``node:<ip>``.
        total: devices of the resource on the node (whole devices, >= 0).
        available: devices not reserved by anything right now (0 <= available <= total).
        alive: False for dead nodes; the planner ignores them.
        labels: Ray node labels (``Labels``), informational.

    Raises:
        ValueError: when ``total < 0`` or ``available`` is outside ``0..total``.
    """

    node_id: str
    ip: str
    total: int
    available: int
    alive: bool = True
    labels: dict[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.total < 0:
            raise ValueError(f"node {self.node_id}: total must be >= 0, got {self.total}")
        if not 0 <= self.available <= self.total:
            raise ValueError(
                f"node {self.node_id}: available must be within 0..{self.total}, "
                f"got {self.available}"
            )

    @property
    def idle(self) -> bool:
        """True when nothing holds any of the node's devices (``available == total``)."""
        return self.available == self.total


def _floor(value: Any) -> int:
    """Whole devices in a Ray resource amount (floors fractions; tolerates float noise)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0
    if not math.isfinite(number) or number <= 0:
        return 0
    return math.floor(number + _FLOOR_EPSILON)


def nodes_from_ray(
    ray_nodes: list[dict[str, Any]],
    available_by_node: Mapping[str, Mapping[str, float]] | None,
    resource: str,
) -> list[NodeInventory]:
    """Build node inventories from ``ray.nodes()`` output.

    Args:
        ray_nodes: ``ray.nodes()``: dicts with at least ``NodeID``,
            ``NodeManagerAddress``, ``Alive`` and ``Resources`` (resource name ->
            amount, float); ``Labels`` (str -> str) is copied when present.
        available_by_node: node id -> available resources (resource name -> amount),
            e.g. from ``ray._private.state.available_resources_per_node()``. A
            resource missing from a node's mapping counts as 0 available (Ray omits
            exhausted resources); a node missing from the mapping counts as fully
            busy (0 available). ``None`` means nothing is busy (available = total).
        resource: the Ray resource that counts as a device, e.g. ``"GPU"`` or ``"CPU"``.

    Returns:
        One :class:`NodeInventory` per live node that has at least one whole
        device, in input order. Fractional amounts are floored; ``available`` is
        clamped to ``0..total``. Dead nodes and nodes without the resource are
        skipped.
    """
    inventories: list[NodeInventory] = []
    for raw in ray_nodes:
        alive = raw.get("Alive", raw.get("alive", False))
        if not alive:
            continue
        resources = raw.get("Resources") or {}
        total = _floor(resources.get(resource, 0))
        if total < 1:
            continue
        node_id = str(raw["NodeID"])
        if available_by_node is None:
            available = total
        else:
            node_available = available_by_node.get(node_id) or {}
            available = min(total, _floor(node_available.get(resource, 0)))
        labels = {str(k): str(v) for k, v in (raw.get("Labels") or {}).items()}
        inventories.append(
            NodeInventory(
                node_id=node_id,
                ip=str(raw.get("NodeManagerAddress", "")),
                total=total,
                available=available,
                alive=True,
                labels=labels,
            )
        )
    return inventories


def nodes_from_heartbeats(docs: Iterable[Mapping[str, Any]]) -> list[NodeInventory] | None:
    """The nodes the orchestrator with most devices published (``resources["nodes"]`` of
    its heartbeat: ``[{"node_id", "ip", "total", "available"}]``).

    ``docs``: the live orchestrators' resources documents. None when none published
    its nodes.
    """
    best: list[NodeInventory] | None = None
    for r in docs:
        found = r.get("nodes")
        if not isinstance(found, list):
            continue
        nodes = [
            NodeInventory(
                node_id=str(d["node_id"]),
                ip=str(d.get("ip", "")),
                total=int(d["total"]),
                available=min(int(d["total"]), int(d.get("available") or 0)),
            )
            for d in found
            if isinstance(d, dict) and "node_id" in d and "total" in d
        ]
        if best is None or sum(n.total for n in nodes) > sum(n.total for n in best):
            best = nodes
    return best


def devices_from_heartbeats(docs: Iterable[Mapping[str, Any]], resource: str) -> int | None:
    """The most ``resource`` devices one of the live orchestrators (``docs``) reports; None
    when none is live.

    ``resource`` ``"auto"``: each orchestrator's own detected device kind
    (``device_resource`` in its heartbeat; CPU when it published none).
    """
    counts = [int(float(r.get(_heartbeat_kind(r, resource), 0) or 0)) for r in docs]
    return max(counts) if counts else None


def kind_from_heartbeats(docs: Iterable[Mapping[str, Any]], resource: str) -> str:
    """The device kind in force: ``resource`` when set, else the one the live orchestrators
    (``docs``) detected (``"GPU"`` when any of them detected GPUs), else ``"CPU"``."""
    if resource != "auto":
        return resource
    kinds = {_heartbeat_kind(r, resource) for r in docs}
    return "GPU" if "GPU" in kinds else "CPU"


def _heartbeat_kind(resources: Mapping[str, Any], resource: str) -> str:
    """``resource``, or for ``"auto"`` the kind an orchestrator published in its heartbeat."""
    if resource != "auto":
        return resource
    kind = resources.get("device_resource")
    return kind if kind in ("CPU", "GPU") else "CPU"


# --------------------------------------------------------------------------- devices


def reserved_devices(layout: Mapping[str, Any]) -> int:
    """Devices a run reserves: ``layout.devices``, else TP x PP (the one rule;
    ``orchestrator.experiments.spec.Layout.reserved`` asks it too)."""
    tp = int(layout.get("tensor_parallel_size", 1))
    pp = int(layout.get("pipeline_parallel_size", 1))
    return int(layout.get("devices") or tp * pp)


def cpu_thread_binding(layout: Mapping[str, Any], first_core: int = 0) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a run on CPU cores: one core list per rank.

    The run's devices (cores ``first_core ..``) are split evenly over its
    TP x PP ranks: TP=2 on 2 cores -> ``"0|1"``; TP=1 on 2 cores -> ``"0-1"``.
    vLLM's CPU backend needs an explicit binding when TP or PP > 1
    (ENGINE_NOTES.md).
    """
    ranks = int(layout.get("tensor_parallel_size", 1)) * int(
        layout.get("pipeline_parallel_size", 1)
    )
    per = max(1, reserved_devices(layout) // ranks)
    parts = []
    for rank in range(ranks):
        a = first_core + rank * per
        parts.append(f"{a}-{a + per - 1}" if per > 1 else str(a))
    return "|".join(parts)


# --------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class NodeAssignment:
    """The part of a run placed on one node.

    Attributes:
        node_id: Ray node id.
        ip: node IP; the node's bundles carry ``node:<ip>``.
        rank: vLLM ``--node-rank`` (0 .. nnodes-1); rank 0 hosts stage 0.
        stages: pipeline stages hosted here, consecutive and ascending.
        devices: devices vLLM uses on this node (``TP * len(stages)``, or the
            whole ``devices`` request on a single node).
        reserved: devices reserved on this node (``>= devices``; the node's total
            with an exclusive placement).

    Raises:
        ValueError: when ``rank < 0``, ``devices < 1`` or ``reserved < devices``.
    """

    node_id: str
    ip: str
    rank: int
    stages: tuple[int, ...]
    devices: int
    reserved: int

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        if self.reserved < self.devices:
            raise ValueError(f"reserved ({self.reserved}) must be >= devices ({self.devices})")


@dataclass(frozen=True)
class Placement:
    """Where one TP x PP run goes: nodes in rank order, plus the reservation policy.

    Attributes:
        nodes: one :class:`NodeAssignment` per node, ordered by rank (0 first).
        exclusive: True when the run reserves every device of its nodes.
        tp: tensor_parallel_size.
        pp: pipeline_parallel_size.
    """

    nodes: tuple[NodeAssignment, ...]
    exclusive: bool
    tp: int
    pp: int

    @property
    def nnodes(self) -> int:
        """Number of nodes (vLLM ``--nnodes``)."""
        return len(self.nodes)

    @property
    def devices(self) -> int:
        """Devices vLLM uses, summed over nodes."""
        return sum(node.devices for node in self.nodes)

    @property
    def reserved(self) -> int:
        """Devices reserved, summed over nodes (= number of bundles)."""
        return sum(node.reserved for node in self.nodes)

    @property
    def policy(self) -> str:
        """``"exclusive_nodes"`` or ``"shared_nodes"``."""
        return "exclusive_nodes" if self.exclusive else "shared_nodes"

    def bundles(self, resource: str) -> list[dict[str, float]]:
        """Placement-group bundles: one device per bundle, pinned to its node.

        Args:
            resource: the Ray resource name of a device (``"GPU"``, ``"CPU"``).

        Returns:
            ``reserved`` bundles per node, nodes in rank order, each
            ``{resource: 1.0, "node:<ip>": 0.001}``. Bundle ``i`` sits on the node of
            rank :meth:`bundle_node_index` ``[i]``.
        """
        out: list[dict[str, float]] = []
        for node in self.nodes:
            pin = f"{NODE_RESOURCE_PREFIX}{node.ip}"
            out.extend({resource: 1.0, pin: NODE_AFFINITY_AMOUNT} for _ in range(node.reserved))
        return out

    def node_bundles(self, resource: str) -> list[dict[str, float]]:
        """Placement-group bundles: one per node holding all of that node's devices.

        Used for GPUs with vLLM's multiprocessing executor: the launcher actor on
        each node asks for the whole bundle (``num_gpus = reserved``), so Ray hands
        it exactly those GPUs and sets ``CUDA_VISIBLE_DEVICES`` for the engine it
        starts. Returns ``{resource: reserved, "node:<ip>": 0.001}`` per node, in rank
        order (bundle ``i`` is on the node of rank ``i``).
        """
        return [
            {
                resource: float(node.reserved),
                f"{NODE_RESOURCE_PREFIX}{node.ip}": NODE_AFFINITY_AMOUNT,
            }
            for node in self.nodes
        ]

    def bundle_node_index(self) -> list[int]:
        """For each bundle of :meth:`bundles`, the rank of its node (same length and order)."""
        return [node.rank for node in self.nodes for _ in range(node.reserved)]

    def layout_doc(self) -> dict[str, Any]:
        """JSON-safe description of the layout.

        Returns:
            ``{"nodes": [{"node_id", "ip", "rank", "stages", "devices", "reserved"}],
            "exclusive": bool, "policy": "exclusive_nodes" | "shared_nodes",
            "nnodes": int}``; ``stages`` is a list of ints, nodes in rank order.
        """
        return {
            "nodes": [
                {
                    "node_id": node.node_id,
                    "ip": node.ip,
                    "rank": node.rank,
                    "stages": list(node.stages),
                    "devices": node.devices,
                    "reserved": node.reserved,
                }
                for node in self.nodes
            ],
            "exclusive": self.exclusive,
            "policy": self.policy,
            "nnodes": self.nnodes,
        }


# --------------------------------------------------------------------------- solver


def _validate(tp: int, pp: int, devices: int | None) -> int:
    """Check the shape arguments; return the devices the run reserves (>= TP x PP)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
    world = tp * pp
    if devices is None:
        return world
    if devices < world:
        raise ValueError(f"devices ({devices}) must be >= TP x PP = {tp} x {pp} = {world}")
    return devices


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _ip_key(ip: str) -> tuple[int, int, str]:
    """Sort key for IPs: numeric for valid IPv4/IPv6 (v4 first), textual otherwise (last)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return (99, 0, ip)
    return (addr.version, int(addr), ip)


def _node_counts(tp: int, pp: int, need: int) -> list[tuple[int, int]]:
    """Candidate ``(nnodes, devices per node)`` pairs, fewest nodes first."""
    world = tp * pp
    if need > world:  # extra devices: single node only
        return [(1, need)]
    return [(n, world // n) for n in _divisors(pp)]


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _dev(count: int, resource: str | None) -> str:
    kind = f"{resource} device" if resource else "device"
    return _plural(count, kind)


#: Why ``layout.executor: "ray"`` is refused on CPU (at submission and at launch).
RAY_EXECUTOR_ON_CPU = (
    "layout.executor 'ray' needs GPUs: the device kind of this cluster is CPU, and vLLM's "
    "CPU build refuses --distributed-executor-backend ray ('current platform cpu does not "
    "support ray'); use executor 'mp' (one vllm serve per node with --nnodes)"
)


def shape_problem(
    nodes: Iterable[NodeInventory],
    tp: int,
    pp: int,
    devices: int | None = None,
    *,
    resource: str | None = None,
) -> str | None:
    """Why a TP x PP shape can never fit this cluster, ignoring what is busy now.

    Args:
        nodes: the cluster's inventories (dead nodes are ignored; ``total`` counts,
            ``available`` does not).
        tp: tensor_parallel_size (>= 1); each TP group must fit in one node.
        pp: pipeline_parallel_size (>= 1); stages split evenly over ``N`` nodes
            with ``N`` dividing ``pp``.
        devices: devices the run reserves when more than ``tp * pp`` (e.g. CPU
            cores for the API process); only possible on one node.
        resource: resource name used in the messages (``"CPU"`` -> "4 CPU devices").

    Returns:
        An English sentence with the numbers, or None when some idle cluster state
        lets :func:`plan_placement` place the shape. Checked in order: no live
        node; TP larger than every node; more devices than the cluster has;
        ``devices > TP x PP`` with no node big enough; no even split of the stages.

    Raises:
        ValueError: when ``tp < 1``, ``pp < 1`` or ``devices < tp * pp``.
    """
    need = _validate(tp, pp, devices)
    world = tp * pp
    live = [node for node in nodes if node.alive and node.total > 0]
    if not live:
        what = f"{resource} devices" if resource else "devices"
        return f"the cluster has no live node with {what}"
    largest = max(node.total for node in live)
    cluster = sum(node.total for node in live)
    if tp > largest:
        return (
            f"tensor_parallel_size {tp} needs {_dev(tp, resource)} in one node; "
            f"the largest node has {largest}"
        )
    if need > cluster:
        if need > world:
            asked = f"the run reserves {_dev(need, resource)} (TP x PP = {tp} x {pp} = {world})"
        else:
            asked = f"TP x PP = {tp} x {pp} needs {_dev(world, resource)}"
        return f"{asked}; the cluster has {cluster} in total"
    if need > world:
        if need > largest:
            return (
                f"devices > TP x PP is only supported on one node: the run reserves "
                f"{_dev(need, resource)} (TP x PP = {tp} x {pp} = {world}); "
                f"the largest node has {largest}"
            )
        return None
    tried: list[str] = []
    for count, per_node in _node_counts(tp, pp, need):
        big_enough = sum(1 for node in live if node.total >= per_node)
        if big_enough >= count:
            return None
        if count == 1:
            tried.append(f"1 node x {_dev(per_node, resource)} (the largest node has {largest})")
        else:
            tried.append(
                f"{count} nodes x {_dev(per_node, resource)} "
                f"(only {_plural(big_enough, 'node')} with {per_node} or more)"
            )
    return (
        f"pipeline_parallel_size {pp} with tensor_parallel_size {tp} cannot be split "
        f"evenly over the nodes; each node must host the same number of whole stages: "
        + "; ".join(tried)
    )


def plan_placement(
    nodes: Iterable[NodeInventory],
    tp: int,
    pp: int,
    *,
    devices: int | None = None,
    exclusive: bool = False,
) -> Placement | None:
    """Choose nodes, node ranks and stages for a TP x PP run from what is available now.

    Rules:

    - fewest nodes first: ``N`` runs over the divisors of ``pp`` ascending, each
      node needing ``tp * pp / N`` available devices (one node when some node has
      ``tp * pp`` available);
    - among nodes that fit, best fit: the least available devices first (leaves
      big nodes free for big runs), ties by ``node_id``;
    - ranks: the chosen nodes sorted by ``(ip, node_id)`` (IPs compared
      numerically); rank ``r`` hosts stages ``r*pp/N .. (r+1)*pp/N - 1``;
    - ``exclusive=True``: only idle nodes (``available == total``) qualify and the
      run reserves all their devices (``reserved = total``);
    - ``devices > tp * pp``: one node with ``devices`` available, never several.

    Nodes sharing one IP cannot be told apart by ``node:<ip>`` bundles; give
    every node its own IP.

    Args:
        nodes: current inventories (dead nodes ignored).
        tp: tensor_parallel_size (>= 1).
        pp: pipeline_parallel_size (>= 1).
        devices: devices to reserve when more than ``tp * pp`` (single node only).
        exclusive: reserve whole idle nodes so no other run shares them.

    Returns:
        A :class:`Placement`, or None when nothing fits right now -- either the
        cluster is busy (keep the run queued) or the shape can never fit; call
        :func:`shape_problem` to tell the two apart.

    Raises:
        ValueError: when ``tp < 1``, ``pp < 1`` or ``devices < tp * pp``.
    """
    need = _validate(tp, pp, devices)
    eligible = [
        node for node in nodes if node.alive and node.total > 0 and (node.idle or not exclusive)
    ]
    for count, per_node in _node_counts(tp, pp, need):
        fitting = sorted(
            (node for node in eligible if node.available >= per_node),
            key=lambda node: (node.available, node.node_id),
        )
        if len(fitting) < count:
            continue
        chosen = sorted(fitting[:count], key=lambda node: (_ip_key(node.ip), node.node_id))
        stages_per_node = pp // count
        assignments = tuple(
            NodeAssignment(
                node_id=node.node_id,
                ip=node.ip,
                rank=rank,
                stages=tuple(range(rank * stages_per_node, (rank + 1) * stages_per_node)),
                devices=per_node,
                reserved=node.total if exclusive else per_node,
            )
            for rank, node in enumerate(chosen)
        )
        return Placement(nodes=assignments, exclusive=exclusive, tp=tp, pp=pp)
    return None
