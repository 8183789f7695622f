"""On-demand node parity checks (``POST /api/v1/cluster/parity``): the request is
checked as an experiment would be, then stored ``pending`` for an orchestrator to
answer (:func:`orchestrator.cluster.parity.check_parity`, run by the dispatcher).

Checked, listing every problem at once (422 ``parity_request_invalid``): the engine
arguments against vLLM's own list, the node ids and the TP x PP shape against the
nodes the live orchestrators publish, and the model.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from orchestrator.cluster.placement import shape_problem
from orchestrator.core.errors import NotFoundError, ParityRequestInvalidError, SpecInvalidError
from orchestrator.core.models import ParityCheck
from orchestrator.core.repositories import ParityCheckRepository
from orchestrator.core.settings import Settings
from orchestrator.experiments.cluster_view import ClusterView
from orchestrator.experiments.engine_catalog import load_catalog
from orchestrator.experiments.model_resolution import resolve_model


def request_parity_check(
    session: Session, settings: Settings, request: dict[str, Any]
) -> ParityCheck:
    """Check ``request`` (``node_ids``, ``model``, ``engine_args``,
    ``tensor_parallel_size``, ``pipeline_parallel_size``: the API's
    ``ParityCheckRequest`` as JSON) and store it ``pending``, with the model's
    resolved ``model_path`` added."""
    doc = dict(request)
    node_ids: list[str] = doc.get("node_ids") or []
    errors = load_catalog(settings).check(doc.get("engine_args") or {}, ["body", "engine_args"])
    cluster = ClusterView.read(session, settings)
    nodes = cluster.nodes
    if nodes is not None:
        known = {n.node_id for n in nodes}
        for i, node_id in enumerate(node_ids):
            if node_id not in known:
                errors.append(
                    {
                        "loc": ["body", "node_ids", i],
                        "msg": f"no live Ray node {node_id!r}",
                        "type": "unknown_node",
                    }
                )
        chosen = [n for n in nodes if not node_ids or n.node_id in node_ids]
        problem = shape_problem(
            chosen,
            doc.get("tensor_parallel_size", 1),
            doc.get("pipeline_parallel_size", 1),
            resource=cluster.kind,
        )
        if chosen and problem is not None:
            errors.append({"loc": ["body"], "msg": problem, "type": "shape_does_not_fit"})
    if doc.get("model") is not None:
        try:
            doc["model_path"] = str(resolve_model(settings, doc["model"]).path)
        except SpecInvalidError as exc:
            errors += [{**e, "loc": ["body", "model"]} for e in exc.errors]
    if errors:
        raise ParityRequestInvalidError(
            errors, f"{len(errors)} problem(s) in the parity check request"
        )
    return ParityCheckRepository(session).add(doc)


def get_parity_check(session: Session, check_id: str) -> ParityCheck:
    """The check; :class:`NotFoundError` (``parity_check_not_found``) when missing."""
    check = ParityCheckRepository(session).get(check_id)
    if check is None:
        raise NotFoundError(f"no parity check {check_id}", code_hint="parity_check_not_found")
    return check
