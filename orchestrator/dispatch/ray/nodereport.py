"""The parity report of a run's nodes from their probes' fingerprints.

Every field compared (:func:`nodes_report`), or only the engine environments when a node
lacks its engine (:func:`engine_report`). The probes: :mod:`orchestrator.dispatch.ray.probe`.
"""

from __future__ import annotations

import socket
from typing import Any

from jobs.engine.command import render_engine_args
from jobs.engine.nodeprobe import launch_environment
from orchestrator.cluster.parity import check_parity
from orchestrator.cluster.parity_engineenv import engine_env_problem, engine_only

__all__ = ["engine_report", "nodes_report"]


def nodes_report(
    ids: list[str],
    fingerprints: dict[str, dict[str, Any]],
    *,
    model_dir: str | None,
    engine_args: dict[str, Any],
    tp: int,
    pp: int,
) -> dict[str, Any]:
    """:func:`orchestrator.cluster.parity.check_parity` of the nodes ``ids`` in that order,
    each named ``rank<i>:<hostname>`` and carrying the engine arguments it would launch
    with, against the orchestrator's own environment as the launching side; the engine
    environments alone (:func:`engine_report`) when a node lacks its engine."""
    if any(engine_env_problem(fingerprints[n].get("engine_env")) for n in ids):
        shape = {"model": model_dir, "tensor_parallel_size": tp, "pipeline_parallel_size": pp}
        return engine_report(ids, [fingerprints[n] for n in ids], shape)
    ordered = []
    for i, node_id in enumerate(ids):
        fp = dict(fingerprints[node_id])
        fp["node"] = f"rank{i}:{fp.get('hostname') or fp.get('ip') or node_id[:12]}"
        fp["engine_args"] = dict(engine_args)
        fp["launch_args"] = render_engine_args(engine_args)
        ordered.append(fp)
    launch = {
        "model": model_dir,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "launch_env": launch_environment(),
        "launch_env_source": f"the orchestrator's environment on {socket.gethostname()}",
    }
    report = check_parity(ordered, launch)
    report["node_ids"] = ids
    return report


def engine_report(
    node_ids: list[str], fingerprints: list[dict[str, Any]], launch: dict[str, Any]
) -> dict[str, Any]:
    """The parity report of the engine environments alone (a node lacks its engine).

    Each node is ``rank<i>:<hostname>`` as in :meth:`RayRunBackend.check_nodes`; only its
    identity and ``engine_env`` are compared
    (:func:`orchestrator.cluster.parity_engineenv.engine_only`).
    """
    nodes = []
    for i, (node_id, fp) in enumerate(zip(node_ids, fingerprints, strict=True)):
        doc = engine_only(fp)
        doc["node"] = f"rank{i}:{fp.get('hostname') or fp.get('ip') or node_id[:12]}"
        doc["node_id"] = node_id
        nodes.append(doc)
    report = check_parity(nodes, launch)
    report["node_ids"] = list(node_ids)
    report["stage"] = "engine_env"
    report["note"] = (
        "a node lacks the engine environment: the engine was not run and the other fields "
        "(versions, devices, model files, environment variables) were not compared"
    )
    return report
