"""``/api/v1/experiments``: submit an experiment, list and read them, compare and
export their runs (as CSV/Parquet, or to an MLflow tracking server)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, Annotated, Any, Literal

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy.orm import Session

from api.deps import SessionDep, SettingsDep
from api.problems import PROBLEM_JSON
from api.routes.common import Limit, Offset, run_brief, run_out, url_for_id
from api.schemas import (
    ExperimentComparison,
    ExperimentCreated,
    ExperimentListItem,
    ExperimentOut,
    MlflowExportOut,
    MlflowExportRequest,
    Page,
)
from orchestrator.analysis.service import comparison, export_file
from orchestrator.core.models import Experiment
from orchestrator.core.repositories import ExperimentRepository, RunRepository
from orchestrator.experiments import service
from orchestrator.experiments.intake import accept_experiment
from orchestrator.experiments.status import experiment_status, server_reuse
from orchestrator.integrations.mlflow_export import check_api_tracking_uri, export_experiment

router = APIRouter(prefix="/api/v1", tags=["experiments"])

#: The request body is an ``ExperimentSpec``, published in the components by
#: :func:`api.openapi.install` (the handler reads it as JSON so that
#: every problem is reported at once, as ``spec_invalid``).
SPEC_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/ExperimentSpec"}}
        },
    }
}


def _experiment_out(request: Request, session: Session, exp: Experiment) -> ExperimentOut:
    metrics = RunRepository(session).metrics_for([r.id for r in exp.runs])
    return ExperimentOut(
        id=exp.id,
        url=str(request.url_for("get_experiment", experiment_id=exp.id)),
        name=exp.name,
        description=exp.description,
        model_id=exp.model_id,
        model_digest=exp.model_digest,
        model_revision=exp.model_revision,
        request_list_hash=exp.request_list_hash,
        created_at=exp.created_at,
        submitted_by=exp.submitted_by,
        status=experiment_status(list(exp.runs)),
        repeats=exp.repeats,
        variants=exp.variants,
        server_reuse=server_reuse(list(exp.runs)),
        spec=exp.spec,
        runs=[
            run_out(request, r, metrics.get(r.id))
            for r in sorted(exp.runs, key=lambda r: r.sequence)
        ],
    )


@router.post(
    "/experiments", status_code=201, response_model=ExperimentCreated, openapi_extra=SPEC_BODY
)
def create_experiment(
    body: Annotated[Any, Body()],
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
) -> ExperimentCreated:
    """Validate and store an experiment (an ``ExperimentSpec``); its runs are queued.

    422 problem+json (code ``spec_invalid``) names every bad field at once:
    schema problems, unknown engine arguments, an unknown model, variants that
    change more or less than one variable, configurations vLLM refuses;
    nothing is stored then. 503 ``engine_unavailable`` when the engine
    environment cannot list its arguments; 503 ``submissions_busy`` (with
    ``Retry-After``) when too many submissions are being checked already
    (``VLAB_SUBMISSIONS__*``). No database connection is held while vLLM checks
    the configurations. A capacity experiment's answer says how long its searches can
    take at most (``capacity_estimate``, also kept in the experiment's ``spec``).
    """
    exp = accept_experiment(session, settings, body)
    return ExperimentCreated(
        id=exp.id,
        url=str(request.url_for("get_experiment", experiment_id=exp.id)),
        runs=[run_brief(request, r) for r in sorted(exp.runs, key=lambda r: r.sequence)],
        capacity_estimate=(exp.spec or {}).get("capacity_estimate"),
    )


@router.get("/experiments", response_model=Page[ExperimentListItem])
def list_experiments(
    request: Request, session: SessionDep, limit: Limit = 50, offset: Offset = 0
) -> Page[ExperimentListItem]:
    repo = ExperimentRepository(session)
    rows, total = repo.page(limit=limit, offset=offset)
    items = [
        ExperimentListItem(
            id=e.id,
            url=url_for_id(request, "get_experiment", experiment_id=e.id),
            name=e.name,
            model_id=e.model_id,
            created_at=e.created_at,
            status=experiment_status(list(e.runs)),
            run_count=len(e.runs),
        )
        for e in rows
    ]
    return Page(
        items=items, total=total, limit=limit, offset=offset, total_estimated=repo.estimated
    )


@router.get("/experiments/{experiment_id}", response_model=ExperimentOut)
def get_experiment(experiment_id: str, request: Request, session: SessionDep) -> ExperimentOut:
    return _experiment_out(request, session, service.get_experiment(session, experiment_id))


@router.get(
    "/experiments/{experiment_id}/comparison",
    response_model=ExperimentComparison,
    response_model_exclude_unset=True,
)
def get_comparison(experiment_id: str, session: SessionDep) -> ExperimentComparison:
    """Each variant vs its reference: per metric both values, the ratio, a 95 % bootstrap
    CI over repeats and requests, and a verdict (better / worse / no clear difference);
    plus findings (e.g. hit rate up but E2E latency flat). See ``orchestrator.analysis.compare``."""
    return ExperimentComparison.model_validate(comparison(session, experiment_id))


#: What ``GET /experiments/{id}/export`` sends, by ``format`` (CSV as UTF-8 text).
EXPORT_MEDIA = {"csv": "text/csv", "parquet": "application/vnd.apache.parquet"}

EXPORT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The runs as a file: CSV with `format=csv` (the default), Parquet "
        "with `format=parquet`",
        "content": {
            EXPORT_MEDIA["csv"]: {"schema": {"type": "string"}},
            EXPORT_MEDIA["parquet"]: {"schema": {"type": "string", "format": "binary"}},
        },
        "headers": {
            "Content-Disposition": {
                "description": 'attachment; filename="<experiment id>.<format>"',
                "schema": {"type": "string"},
            }
        },
    }
}


@router.get(
    "/experiments/{experiment_id}/export", response_class=Response, responses=EXPORT_RESPONSES
)
def export_runs(
    experiment_id: str,
    session: SessionDep,
    format: Annotated[Literal["csv", "parquet"], Query()] = "csv",
) -> Response:
    """The experiment's runs as CSV (``text/csv``) or Parquet
    (``application/vnd.apache.parquet``): one row per run, configuration and metrics
    flattened into dotted columns (``engine_args.enable_prefix_caching``,
    ``metrics.median_ttft_ms``). Streamed: the runs are read and written a batch at a
    time, in memory that does not grow with their number."""
    # built whole (in a temporary file, constant memory) before the first byte: a
    # database error is a problem response, never a cut-off file
    body, size = export_file(session, experiment_id, format)
    return StreamingResponse(
        _chunks(body),
        media_type=EXPORT_MEDIA[format],
        headers={
            "content-disposition": f'attachment; filename="{experiment_id}.{format}"',
            "content-length": str(size),
        },
    )


def _chunks(body: IO[bytes], size: int = 1 << 16) -> Iterator[bytes]:
    """``body``'s bytes, ``size`` at a time; then it is closed."""
    with body:
        while chunk := body.read(size):
            yield chunk


def _problem(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }


@router.post(
    "/experiments/{experiment_id}/export/mlflow",
    response_model=MlflowExportOut,
    responses={
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
def export_to_mlflow(
    experiment_id: str,
    body: MlflowExportRequest,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
) -> MlflowExportOut:
    """Export the experiment's runs to an MLflow tracking server: one MLflow run per
    finished run, params = the resolved engine arguments, layout and workload, metrics =
    the summary metrics (finite ones; unknown ones named in the tag
    ``vlab.unknown_metrics``, never written as 0), the ``/metrics`` time series as metric
    history, tags = experiment, variant, changed variable, request-list hash, status.

    Idempotent: a run exported before is left as it is (``unchanged``) unless ``replace``.
    Only ``http(s)`` tracking URIs unless ``VLAB_MLFLOW__ALLOW_LOCAL_STORES`` (422
    ``export_request_invalid``). See ``orchestrator.integrations.mlflow_export``.
    """
    uri = check_api_tracking_uri(body.tracking_uri, settings.mlflow)
    report = export_experiment(
        session,
        experiment_id,
        uri,
        experiment_name=body.experiment_name,
        include_failed=body.include_failed,
        replace=body.replace,
        max_points=body.max_points,
        connect_timeout_s=settings.mlflow.connect_timeout_s,
        base_url=settings.api.public_url or str(request.base_url),
    )
    return MlflowExportOut.model_validate(report.as_dict())
