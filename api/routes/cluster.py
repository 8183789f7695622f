"""``/api/v1/cluster/parity``: on-demand node parity checks (admin)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api import auth
from api.deps import SessionDep, SettingsDep
from api.schemas import ParityCheckOut, ParityCheckRequest
from orchestrator.core.models import ParityCheck
from orchestrator.experiments import parity_requests

router = APIRouter(prefix="/api/v1", tags=["cluster"])


def _parity_out(request: Request, check: ParityCheck) -> ParityCheckOut:
    return ParityCheckOut(
        id=check.id,
        url=str(request.url_for("get_parity_check", check_id=check.id)),
        status=check.status,
        created_at=check.created_at,
        finished_at=check.finished_at,
        request=check.request,
        report=check.report,
        error=check.error,
    )


@router.post(
    "/cluster/parity",
    response_model=ParityCheckOut,
    status_code=202,
    dependencies=[auth.RequireAdmin],
)
def post_parity_check(
    body: ParityCheckRequest,
    request: Request,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
) -> ParityCheckOut:
    """Check a set of Ray nodes for environment parity, on demand.

    Stored ``pending`` and answered by an orchestrator, which runs the node
    probe in the engine environment on every node and compares the
    fingerprints (:func:`orchestrator.cluster.parity.check_parity`). Poll the
    ``Location`` until ``status`` is ``done`` (``report.verdict`` is ``ok``,
    ``blocked``, or ``unknown`` when a blocking rule could not be decided, with
    ``report.verdict_reasons``; warn-only findings are in ``report.warnings``,
    undecided rules in ``report.unknown``) or ``failed``.

    Checked here, as for experiments (422 listing every problem): the engine
    arguments against vLLM's own list, the node ids and the TP x PP shape
    against the nodes the live orchestrators publish, and the model.
    """
    check = parity_requests.request_parity_check(session, settings, body.model_dump(mode="json"))
    out = _parity_out(request, check)
    response.headers["Location"] = out.url
    return out


@router.get("/cluster/parity/{check_id}", response_model=ParityCheckOut)
def get_parity_check(check_id: str, request: Request, session: SessionDep) -> ParityCheckOut:
    """An on-demand parity check and, once done, its report."""
    return _parity_out(request, parity_requests.get_parity_check(session, check_id))
