"""The layout document a Ray launch records: where each node part of a run is.

What the run got (:func:`actual_layout`, read back from its placement group), what it
was planned to get when it was blocked before one (:func:`planned_layout`), and each
node's engine python in it (:func:`record_engines`). The launch itself:
:class:`orchestrator.dispatch.ray.backend.RayRunBackend`.
"""

from __future__ import annotations

from typing import Any

from ray.util.placement_group import PlacementGroup, placement_group_table

from jobs.schemas import NodePart
from orchestrator.cluster.placement import Placement, cpu_thread_binding
from orchestrator.core.settings import Settings

__all__ = ["actual_layout", "engine_summary", "planned_layout", "record_engines"]


def actual_layout(
    pg: PlacementGroup,
    plan: Placement,
    specs: list[dict[str, float]],
    *,
    resource: str,
    ips: dict[str, str],
    gpus_per_bundle: bool = False,
) -> tuple[list[NodePart], dict[str, Any]]:
    """The node parts as Ray placed the bundles, and the layout document to record.

    ``resource``: the device kind; ``ips``: each live node's IP by node id.
    ``gpus_per_bundle``: each node has one bundle with all its GPUs, which its
    launcher holds (``NodePart.gpus``).
    """
    bundles, reserved = _bundles_by_node(pg, specs, resource)
    order = list(bundles)
    per_node = plan.devices // max(1, len(order))
    parts: list[NodePart] = []
    first_core: dict[str, int] = {}
    for rank, node_id in enumerate(order):
        ip = ips.get(node_id, "")
        used = plan.devices if len(order) == 1 else per_node
        env: dict[str, str] = {}
        if resource == "CPU":
            # each node binds its own cores; nodes sharing a host (a test cluster) get
            # consecutive cores so their engines do not share one
            start = first_core.get(ip, 0)
            local = {"tensor_parallel_size": plan.tp, "devices": used}
            local["pipeline_parallel_size"] = plan.pp // len(order)
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(local, start)
            first_core[ip] = start + used
        parts.append(
            NodePart(
                rank=rank,
                node_id=node_id,
                ip=ip,
                bundle_index=bundles[node_id][0],
                devices=used,
                gpus=reserved[node_id] if gpus_per_bundle else 0,
                env=env,
            )
        )
    doc = {
        "nodes": [
            {
                "rank": p.rank,
                "node_id": p.node_id,
                "ip": p.ip,
                "devices": p.devices,
                "reserved": reserved[p.node_id],
                "bundles": bundles[p.node_id],
                "stages": list(
                    range(p.rank * plan.pp // len(order), (p.rank + 1) * plan.pp // len(order))
                ),
                **({"cpu_binding": p.env["VLLM_CPU_OMP_THREADS_BIND"]} if p.env else {}),
            }
            for p in parts
        ],
        "nnodes": len(parts),
        "exclusive": plan.exclusive,
        "policy": plan.policy,
        "resource": resource,
        "bundle_shape": "per_node" if gpus_per_bundle else "per_device",
        "tensor_parallel_size": plan.tp,
        "pipeline_parallel_size": plan.pp,
    }
    return parts, doc


def _bundles_by_node(
    pg: PlacementGroup, specs: list[dict[str, float]], resource: str
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Where Ray put each bundle: ``{node_id: [bundle index]}`` in the order of each node's
    first bundle, and the devices reserved on each node."""
    table = placement_group_table(pg)
    by_bundle: dict[int, str] = {
        int(i): str(n) for i, n in (table.get("bundles_to_node_id") or {}).items()
    }
    bundles: dict[str, list[int]] = {}
    reserved: dict[str, int] = {}
    for i, spec in enumerate(specs):
        node_id = by_bundle.get(i, "")
        bundles.setdefault(node_id, []).append(i)
        reserved[node_id] = reserved.get(node_id, 0) + int(spec.get(resource, 0))
    return bundles, reserved


def planned_layout(
    plan: Placement,
    engines: dict[str, dict[str, Any]],
    *,
    executor: str,
    resource: str,
    resource_source: str,
    engine_env: dict[str, Any],
) -> dict[str, Any]:
    """The layout of a launch blocked before its placement group: the planned nodes."""
    doc: dict[str, Any] = {
        "nodes": [
            {
                "rank": n.rank,
                "node_id": n.node_id,
                "ip": n.ip,
                "devices": n.devices,
                "reserved": n.reserved,
                "stages": list(n.stages),
            }
            for n in plan.nodes
        ],
        "nnodes": plan.nnodes,
        "planned": True,
        "exclusive": plan.exclusive,
        "policy": plan.policy,
        "resource": resource,
        "tensor_parallel_size": plan.tp,
        "pipeline_parallel_size": plan.pp,
        "executor": executor,
        "device_kind_source": resource_source,
    }
    for node in doc["nodes"]:
        spec = engines.get(node["node_id"]) or {}
        node["engine_python"] = spec.get("python")
        node["engine_python_source"] = spec.get("source")
    doc["engine_env"] = engine_env
    return doc


def engine_summary(settings: Settings) -> dict[str, Any]:
    """How the engine runs on the nodes: ``{"kind": "path" | "image", "image_uri"?}``."""
    summary: dict[str, Any] = {"kind": settings.engine.kind}
    if settings.engine.image_uri:
        summary["image_uri"] = settings.engine.image_uri
    return summary


def record_engines(
    doc: dict[str, Any], parts: list[NodePart], engines: dict[str, dict[str, Any]]
) -> None:
    """Write each node's engine python (and the setting that chose it) into the layout."""
    for node in doc.get("nodes") or []:
        spec = engines.get(str(node.get("node_id"))) or {}
        node["engine_python"] = spec.get("python")
        node["engine_python_source"] = spec.get("source")
    first = engines.get(parts[0].node_id) or {} if parts else {}
    doc["engine_env"] = {k: first[k] for k in ("kind", "image_uri") if k in first}
