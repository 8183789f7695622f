"""``/api/v1/campaigns``: start a tuning campaign, list and read campaigns (status, path,
candidates with verdicts, confirmation, runs), cancel one, export one to an MLflow tracking
server. The dispatcher's ``campaigns`` loop advances them
(:mod:`orchestrator.tuning.service`)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session

from api.deps import SessionDep, SettingsDep
from api.problems import PROBLEM_JSON
from api.routes.common import Limit, Offset, run_url, url_for_id
from api.schemas import (
    CampaignCandidateOut,
    CampaignConfirmationOut,
    CampaignGain,
    CampaignListItem,
    CampaignMlflowExportOut,
    CampaignMlflowExportRequest,
    CampaignOut,
    CampaignRunOut,
    CampaignSpaceNoteOut,
    CampaignStepOut,
    CampaignWallTimeOut,
    Page,
)
from orchestrator.core.models import Campaign
from orchestrator.core.repositories import CampaignRepository
from orchestrator.integrations.mlflow_campaign import export_campaign
from orchestrator.integrations.mlflow_export import check_api_tracking_uri
from orchestrator.tuning import service as tuning
from orchestrator.tuning.campaign_request import CampaignRequest
from orchestrator.tuning.intake import accept_campaign

#: A campaign's status, as a list filter.
CampaignStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]

router = APIRouter(prefix="/api/v1", tags=["campaigns"])


def _problem(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }


def _gain(doc: dict[str, Any] | None) -> CampaignGain | None:
    return CampaignGain.from_stored(doc)


def _proposal(notes: list[dict[str, Any]] | None) -> list[CampaignSpaceNoteOut] | None:
    """The notes of a ``"space": "auto"`` campaign's proposal (None for a listed space)."""
    return None if notes is None else [CampaignSpaceNoteOut(**n) for n in notes]


def campaign_out(request: Request, session: Session, row: Campaign) -> CampaignOut:
    """``row`` as the API shows it; its runs' statuses read now (the stored result has them
    as of the last advance)."""
    result = row.result or {}
    runs = [r for r in CampaignRepository(session).runs(row.id) if r.campaign_label]
    confirmation = result.get("confirmation")
    return CampaignOut(
        id=row.id,
        url=url_for_id(request, "get_campaign", campaign_id=row.id),
        name=row.name,
        status=row.status,
        status_reason=row.status_reason,
        submitted_by=row.submitted_by,
        created_at=row.created_at,
        updated_at=row.updated_at,
        request=row.request,
        phase=result.get("phase"),
        runs_used=result.get("runs_used", 0),
        budget=result.get("budget", (row.request.get("budget") or {}).get("max_runs", 0)),
        start=result.get("start", {}),
        incumbent=result.get("incumbent", {}),
        path=[
            CampaignStepOut(
                round=s["round"],
                variable=s["variable"],
                from_level=s["from_level"],
                to_level=s["to_level"],
                verdict=s["verdict"],
                effect=s["effect"],
                gain=_gain(s["gain"]),
                reason=s["reason"],
            )
            for s in result.get("path", [])
        ],
        candidates=[
            CampaignCandidateOut(
                round=c["round"],
                label=c["label"],
                variable=c["candidate"]["variable"],
                from_level=c["candidate"]["from_level"],
                to_level=c["candidate"]["to_level"],
                outcome=c["outcome"],
                verdict=c["verdict"],
                pairs=c["pairs"],
                effect=c.get("effect"),
                gain=_gain(c.get("gain")),
                reason=c["reason"],
            )
            for c in result.get("candidates", [])
        ],
        cumulative=_gain(result.get("cumulative")),
        confirmation=(
            CampaignConfirmationOut(
                total=_gain(confirmation["total"]),
                steps=_gain(confirmation["steps"]),
                interaction=_gain(confirmation["interaction"]),
                agrees=confirmation["agrees"],
            )
            if confirmation
            else None
        ),
        pending=result.get("pending", []),
        runs=[
            CampaignRunOut(
                label=str(r.campaign_label),
                id=r.id,
                status=r.status,
                experiment_id=r.experiment_id,
                url=run_url(request, r.id),
            )
            for r in runs
        ],
        **{k: result.get(k, {}) for k in ("retried", "retry_reasons", "unmeasured")},
        wall_time=CampaignWallTimeOut(**wall) if (wall := result.get("wall_time")) else None,
        serve_command=result.get("serve_command"),
        spec=result.get("spec"),
        space_proposal=_proposal(result.get("space_proposal")),
        slots=result.get("slots"),
    )


@router.post(
    "/campaigns",
    status_code=201,
    response_model=CampaignOut,
    responses={
        422: _problem(
            "The campaign is invalid (`campaign_invalid`: its objective, space, budget, or "
            "the experiment its first round would submit), every problem listed"
        ),
        503: _problem(
            "The engine environment cannot list its arguments (`engine_unavailable`) or too "
            "many submissions are being checked (`submissions_busy`, with `Retry-After`)"
        ),
    },
)
def create_campaign(
    body: CampaignRequest, request: Request, session: SessionDep, settings: SettingsDep
) -> CampaignOut:
    """Start a tuning campaign (a ``CampaignRequest``): stored ``queued``; the dispatcher's
    ``campaigns`` loop queues its runs, one experiment per cycle, and writes what it
    decides. The space's variables are checked as engine arguments, the objective is one
    of the stored run metrics, and the experiment of its first round (the start and every
    one-variable neighbour) is checked as ``POST /experiments`` checks one; nothing is
    stored on a 422."""
    row = accept_campaign(session, settings, body.model_dump(mode="json", exclude_unset=True))
    return campaign_out(request, session, row)


@router.get("/campaigns", response_model=Page[CampaignListItem])
def list_campaigns(
    request: Request,
    session: SessionDep,
    limit: Limit = 50,
    offset: Offset = 0,
    status: CampaignStatus | None = None,
) -> Page[CampaignListItem]:
    """Newest first; ``status`` keeps the campaigns in that status (another value is a 422)."""
    repo = CampaignRepository(session)
    rows, total = repo.page(limit=limit, offset=offset, status=status)
    counts = repo.run_counts([r.id for r in rows])
    items = [
        CampaignListItem(
            id=r.id,
            url=url_for_id(request, "get_campaign", campaign_id=r.id),
            name=r.name,
            status=r.status,
            objective=str((r.request.get("objective") or {}).get("metric", "")),
            created_at=r.created_at,
            updated_at=r.updated_at,
            run_count=counts.get(r.id, 0),
        )
        for r in rows
    ]
    return Page(items=items, total=total, limit=limit, offset=offset)


@router.get(
    "/campaigns/{campaign_id}",
    response_model=CampaignOut,
    responses={404: _problem("No such campaign (`campaign_not_found`)")},
)
def get_campaign(campaign_id: str, request: Request, session: SessionDep) -> CampaignOut:
    """The campaign: status, path (each adopted step with its effect and interval),
    candidates with their verdicts and reasons, the confirmation, and its runs by label."""
    return campaign_out(request, session, tuning.get_campaign(session, campaign_id))


@router.post(
    "/campaigns/{campaign_id}/cancel",
    response_model=CampaignOut,
    responses={
        404: _problem("No such campaign (`campaign_not_found`)"),
        409: _problem("The campaign already ended (`campaign_already_ended`)"),
    },
)
def cancel_campaign(campaign_id: str, request: Request, session: SessionDep) -> CampaignOut:
    """Cancel the campaign: its queued runs end ``cancelled`` and it ends ``cancelled``;
    runs already started finish and are kept."""
    return campaign_out(request, session, tuning.cancel_campaign(session, campaign_id))


@router.post(
    "/campaigns/{campaign_id}/export/mlflow",
    response_model=CampaignMlflowExportOut,
    responses={
        404: _problem("No such campaign (`campaign_not_found`)"),
        409: _problem(
            "The MLflow experiment of that name is deleted (`mlflow_experiment_deleted`)"
        ),
        501: _problem("The mlflow package is not installed (`mlflow_not_installed`)"),
        502: _problem(
            "The tracking server cannot be reached (`mlflow_unreachable`) or refused or "
            "failed a request (`mlflow_error`, with `runs_done`)"
        ),
    },
)
def export_campaign_to_mlflow(
    campaign_id: str,
    body: CampaignMlflowExportRequest,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
) -> CampaignMlflowExportOut:
    """Export the campaign to an MLflow tracking server (``vlab export mlflow-campaign``):
    a parent run (objective, space, rule, start and final configuration as params; the
    cumulative gain with its interval and each adopted step's gain as metrics; verdicts as
    tags; the path as a JSON artifact), with the campaign's runs exported as
    ``POST /experiments/{id}/export/mlflow`` exports them and nested under it.

    Idempotent: a parent exported when the campaign was as it is now is left as it is
    (``unchanged``), and so are runs exported before, unless ``replace``. Only ``http(s)``
    tracking URIs unless ``VLAB_MLFLOW__ALLOW_LOCAL_STORES`` (422
    ``export_request_invalid``). See ``orchestrator.integrations.mlflow_campaign``.
    """
    uri = check_api_tracking_uri(body.tracking_uri, settings.mlflow)
    report = export_campaign(
        session,
        campaign_id,
        uri,
        experiment_name=body.experiment_name,
        replace=body.replace,
        max_points=body.max_points,
        connect_timeout_s=settings.mlflow.connect_timeout_s,
        base_url=settings.api.public_url or str(request.base_url),
    )
    return CampaignMlflowExportOut.model_validate(report.as_dict())
