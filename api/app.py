"""The FastAPI application: ``/api/v1`` routers, ``/healthz``, problem+json, dashboard mount."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from api import auth, limits, problems
from api.deps import SessionDep, SettingsDep
from api.openapi import declare_problems
from api.schemas import (
    ExperimentCreated,
    ExperimentListItem,
    ExperimentOut,
    FireBrief,
    FireOut,
    IsoDatetime,
    Page,
    ParityCheckOut,
    ParityCheckRequest,
    RequestOut,
    RunBrief,
    RunMetricsOut,
    RunOut,
    RunParityOut,
    SampleOut,
    ScheduleIn,
    ScheduleOut,
    ScheduleUpdate,
)
from orchestrator.core.db import database_health, release_connection, watch
from orchestrator.core.errors import (
    NotFoundError,
    ParityRequestInvalidError,
    QueryInvalidError,
    ScheduleInvalidError,
    SpecInvalidError,
)
from orchestrator.core.models import Experiment, ParityCheck, Run, Schedule, ScheduleFire
from orchestrator.core.repositories import (
    ExperimentRepository,
    OrchestratorRepository,
    ParityCheckRepository,
    RunRepository,
    ScheduleRepository,
    utcnow,
)
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus
from orchestrator.experiments import service
from orchestrator.experiments.config_check import gate_for
from orchestrator.experiments.engine_catalog import load_catalog
from orchestrator.experiments.spec import CHANGES_SCHEMA, NAME_PATTERN, ExperimentSpec, Variant
from orchestrator.runs.history import (
    SORT_KEYS,
    HistoryFilter,
    HistoryQueryError,
    history_page,
    parse_engine_arg,
)

WEB_DIR = Path(__file__).resolve().parent.parent / "web" / "static"


Limit = Annotated[int, Query(ge=1, le=500)]
Offset = Annotated[int, Query(ge=0, le=10**12)]


def experiment_status(runs: list[Run]) -> str:
    """Aggregate status: queued, running, succeeded, failed or cancelled."""
    statuses = {r.status for r in runs}
    if not statuses or statuses == {RunStatus.QUEUED.value}:
        return "queued"
    if statuses & {"queued", "preparing", "running"}:
        return "running"
    if statuses == {"succeeded"}:
        return "succeeded"
    if statuses & {"failed", "blocked"}:
        return "failed"
    return "cancelled"


def server_reuse(runs: list[Run]) -> dict[str, Any]:
    """How many runs reused a running vLLM server, and the start-up seconds that saved."""
    reused = [r for r in runs if (r.engine_info or {}).get("server_reused")]
    return {
        "runs_on_reused_server": len(reused),
        "server_starts": sum(
            1 for r in runs if r.engine_info and not r.engine_info.get("server_reused")
        ),
        "startup_saved_s": round(
            sum(float((r.timings or {}).get("startup_saved_s", 0.0)) for r in reused), 3
        ),
    }


def _run_url(request: Request, run_id: str) -> str:
    return str(request.url_for("get_run", run_id=run_id))


def _brief(request: Request, r: Run) -> RunBrief:
    return RunBrief(
        id=r.id,
        name=r.name,
        position=r.position,
        repeat_index=r.repeat_index,
        sequence=r.sequence,
        status=r.status,
        url=_run_url(request, r.id),
    )


def _run_out(request: Request, run: Run, metrics: dict[str, float] | None = None) -> RunOut:
    data: dict[str, Any] = {k: getattr(run, k) for k in RunOut.model_fields if hasattr(run, k)}
    data["url"] = _run_url(request, run.id)
    data["metrics"] = metrics
    return RunOut.model_validate(data)


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
            _run_out(request, r, metrics.get(r.id))
            for r in sorted(exp.runs, key=lambda r: r.sequence)
        ],
    )


router = APIRouter(prefix="/api/v1")


_SPEC_SCHEMA = ExperimentSpec.model_json_schema(ref_template="#/components/schemas/{model}")
_SPEC_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/ExperimentSpec"}}
        },
    }
}


@router.post(
    "/experiments", status_code=201, response_model=ExperimentCreated, openapi_extra=_SPEC_BODY
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
    the configurations.
    """
    release_connection(session)  # nothing held while waiting for a slot or for vLLM
    with gate_for(settings).slot():
        catalog = load_catalog(settings)
        spec = service.parse_spec(body, settings, catalog)
        exp = service.submit_experiment(
            session, settings, spec, catalog, resolver=service.engine_resolver(settings)
        )
    return ExperimentCreated(
        id=exp.id,
        url=str(request.url_for("get_experiment", experiment_id=exp.id)),
        runs=[_brief(request, r) for r in sorted(exp.runs, key=lambda r: r.sequence)],
    )


@router.get("/experiments", response_model=Page[ExperimentListItem])
def list_experiments(
    request: Request, session: SessionDep, limit: Limit = 50, offset: Offset = 0
) -> Page[ExperimentListItem]:
    rows, total = ExperimentRepository(session).page(limit=limit, offset=offset)
    items = [
        ExperimentListItem(
            id=e.id,
            url=str(request.url_for("get_experiment", experiment_id=e.id)),
            name=e.name,
            model_id=e.model_id,
            created_at=e.created_at,
            status=experiment_status(list(e.runs)),
            run_count=len(e.runs),
        )
        for e in rows
    ]
    return Page(items=items, total=total, limit=limit, offset=offset)


@router.get("/experiments/{experiment_id}", response_model=ExperimentOut)
def get_experiment(experiment_id: str, request: Request, session: SessionDep) -> ExperimentOut:
    return _experiment_out(request, session, service.get_experiment(session, experiment_id))


@router.get("/experiments/{experiment_id}/comparison")
def get_comparison(experiment_id: str, session: SessionDep) -> dict[str, Any]:
    """Each variant vs its reference: per metric both values, the ratio, a 95 % bootstrap
    CI over repeats and requests, and a verdict (better / worse / no clear difference);
    plus findings (e.g. hit rate up but E2E latency flat). See ``orchestrator.analysis.compare``."""
    from orchestrator.analysis.service import comparison

    return comparison(session, experiment_id)


@router.get("/experiments/{experiment_id}/export")
def export_runs(
    experiment_id: str,
    session: SessionDep,
    format: Annotated[Literal["csv", "parquet"], Query()] = "csv",
) -> Response:
    """The experiment's runs as CSV or Parquet: one row per run, configuration and metrics
    flattened into dotted columns (``engine_args.enable_prefix_caching``,
    ``metrics.median_ttft_ms``)."""
    from orchestrator.analysis.service import export

    body = export(session, experiment_id, format)
    media = "text/csv" if format == "csv" else "application/vnd.apache.parquet"
    return Response(
        body,
        media_type=media,
        headers={"content-disposition": f'attachment; filename="{experiment_id}.{format}"'},
    )


@router.get("/runs", response_model=Page[RunOut])
def list_runs(
    request: Request,
    session: SessionDep,
    experiment_id: str | None = None,
    status: RunStatus | None = None,
    model: Annotated[str | None, Query(max_length=500, description="model id, exact")] = None,
    experiment: Annotated[
        str | None, Query(max_length=200, description="experiment id, or part of its name")
    ] = None,
    engine_arg: Annotated[
        str | None,
        Query(
            max_length=500,
            json_schema_extra={"pattern": r"^$|^[A-Za-z_][A-Za-z0-9_-]*="},
            description="name=value, value read as JSON: enable_prefix_caching=true",
        ),
    ] = None,
    since: Annotated[IsoDatetime | None, Query(description="submitted at or after")] = None,
    until: Annotated[
        IsoDatetime | None,
        Query(description="submitted before (exclusive; a date alone means its midnight UTC)"),
    ] = None,
    sort: Annotated[
        str | None,
        Query(
            max_length=50,
            description="one of "
            + ", ".join(SORT_KEYS)
            + "; default: sequence with experiment_id, else submitted",
        ),
    ] = None,
    order: Literal["asc", "desc"] | None = None,
    limit: Limit = 50,
    offset: Offset = 0,
) -> Page[RunOut]:
    """The run history: filtered, sorted, paginated (the dashboard's first page uses the
    same query, :func:`orchestrator.runs.history.history_page`). Runs without the sort value
    (e.g. no metric yet) come last."""
    try:
        if since and until and until <= since:
            raise HistoryQueryError("until", "until must be after since")
        flt = HistoryFilter(
            experiment_id=experiment_id,
            model=model,
            status=status.value if status else None,
            experiment=experiment,
            engine_arg=parse_engine_arg(engine_arg) if engine_arg else None,
            since=since,
            until=until,
        )
        key = sort or ("sequence" if experiment_id else "submitted")
        descending = (order or ("asc" if key == "sequence" else "desc")) == "desc"
        page = history_page(
            session, flt, sort=key, descending=descending, limit=limit, offset=offset
        )
    except HistoryQueryError as exc:
        raise QueryInvalidError(exc.field, str(exc)) from None
    return Page(
        items=[_run_out(request, row.run, row.run_metrics or None) for row in page.rows],
        total=page.total,
        limit=limit,
        offset=offset,
    )


@router.get("/runs/{run_id}", response_model=RunOut)
def get_run(run_id: str, request: Request, session: SessionDep) -> RunOut:
    run = service.get_run(session, run_id)
    return _run_out(request, run, RunRepository(session).metrics(run_id))


@router.get("/runs/{run_id}/metrics", response_model=RunMetricsOut)
def get_run_metrics(
    run_id: str,
    session: SessionDep,
    max_points: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> RunMetricsOut:
    """Summary metrics (``vllm bench serve`` names, plus server-side ones) and the time series.

    The ``/metrics`` time series (one scrape per second) is downsampled to at most
    ``max_points`` points during the measured phase
    (:func:`orchestrator.runs.timeseries.downsample`:
    counters keep their last value per bin, gauges their maximum); ``samples_total``
    is the number stored.
    """
    from orchestrator.runs.timeseries import downsample

    run = service.get_run(session, run_id)
    repo = RunRepository(session)
    stored = repo.samples(run_id)
    return RunMetricsOut(
        run_id=run.id,
        status=run.status,
        partial=run.partial,
        metrics=repo.metrics(run_id),
        samples=[
            SampleOut(t_s=p.t_s, phase=p.phase, values=p.values)
            for p in downsample(stored, max_points)
        ],
        samples_total=len(stored),
    )


@router.get("/runs/{run_id}/requests", response_model=Page[RequestOut])
def get_run_requests(
    run_id: str,
    session: SessionDep,
    limit: Limit = 100,
    offset: Offset = 0,
    request_class: Annotated[str | None, Query(max_length=50)] = None,
    warmup: bool | None = None,
) -> Page[RequestOut]:
    """The run's per-request records in send order, optionally one class or warm-up state."""
    service.get_run(session, run_id)
    rows, total = RunRepository(session).requests(
        run_id, limit=limit, offset=offset, request_class=request_class, warmup=warmup
    )
    return Page(
        items=[RequestOut.model_validate(r, from_attributes=True) for r in rows],
        total=total,
        limit=limit,
        offset=offset,
    )


@router.get("/runs/{run_id}/log", response_class=PlainTextResponse)
def get_run_log(run_id: str, session: SessionDep, raw: bool = False) -> PlainTextResponse:
    """The engine log captured for the run (text/plain).

    By default successful ``/health``, ``/metrics`` and ``/ping`` probe lines
    are filtered out (a failing probe stays); ``?raw=1`` returns the whole
    log. ``X-Noise-Lines-Dropped`` says how many lines the filter removed.
    """
    from jobs.enginelog import filter_noise

    run = service.get_run(session, run_id)
    content = RunRepository(session).log(run_id)
    if content is None:  # running, or lost before its end: the log file on disk
        from orchestrator.dispatch.dispatcher import engine_log_from_disk

        content = engine_log_from_disk(run)
    if content is None:
        raise NotFoundError(f"run {run_id} has no engine log yet", code_hint="log_not_found")
    dropped = 0
    if not raw:
        content, dropped = filter_noise(content)
    return PlainTextResponse(content, headers={"X-Noise-Lines-Dropped": str(dropped)})


class VariantIn(BaseModel):
    """A new variant cloned from a run with exactly one change."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    changes: dict[str, Any] = Field(min_length=1, json_schema_extra=CHANGES_SCHEMA)


@router.post("/runs/{run_id}/variants", status_code=201, response_model=list[RunBrief])
def add_variant(
    run_id: str,
    body: VariantIn,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
) -> list[RunBrief]:
    """Clone the run's variant with one change; its repeats are queued after the experiment's.

    The new variant's reference is the cloned run's variant. 422 problem+json
    under the same rules as a new experiment (one variable, known engine
    arguments, a level that differs from the reference); 503 ``submissions_busy``
    as for a new experiment.
    """
    try:
        variant = Variant(name=body.name, changes=body.changes)
    except ValidationError as exc:
        raise SpecInvalidError.from_validation(exc) from exc
    release_connection(session)
    with gate_for(settings).slot():
        catalog = load_catalog(settings)
        runs = service.submit_variant(
            session,
            settings,
            catalog,
            run_id,
            variant,
            resolver=service.engine_resolver(settings),
        )
    return [_brief(request, r) for r in runs]


@router.post("/runs/{run_id}/cancel", response_model=RunOut, status_code=202)
def cancel_run(run_id: str, request: Request, session: SessionDep) -> RunOut:
    """Cancel a run: queued runs end at once; active ones are stopped by their orchestrator."""
    return _run_out(request, service.request_cancel(session, run_id))


@router.get("/runs/{run_id}/parity", response_model=RunParityOut)
def get_run_parity(run_id: str, session: SessionDep) -> RunParityOut:
    """The node parity report checked before the run's multi-node launch.

    404 when the run has none: single-node runs launch without one, and a
    queued run has not been placed yet.
    """
    run = service.get_run(session, run_id)
    if run.parity is None:
        raise NotFoundError(
            f"run {run_id} has no parity report: "
            + ("it has not been placed yet" if run.status == "queued" else "it ran on one node"),
            code_hint="parity_not_found",
        )
    return RunParityOut(
        run_id=run.id, status=run.status, placement=run.placement, report=run.parity
    )


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
    body: ParityCheckRequest, request: Request, response: Response, session: SessionDep
) -> ParityCheckOut:
    """Check a set of Ray nodes for environment parity, on demand.

    Stored ``pending`` and answered by an orchestrator, which runs the node
    probe in the engine environment on every node and compares the
    fingerprints (:func:`orchestrator.cluster.parity.check_parity`). Poll the
    ``Location`` until ``status`` is ``done`` (``report.verdict`` is ``ok`` or
    ``blocked``; warn-only findings are in ``report.warnings``) or ``failed``.

    Checked here, as for experiments (422 listing every problem): the engine
    arguments against vLLM's own list, the node ids and the TP x PP shape
    against the nodes the live orchestrators publish, and the model.
    """
    from orchestrator.cluster.placement import shape_problem

    settings: Settings = request.app.state.settings
    doc = body.model_dump(mode="json")
    errors = load_catalog(settings).check(body.engine_args, ["body", "engine_args"])
    nodes = OrchestratorRepository(session).cluster_nodes(
        settings.orchestrator.device_resource, settings.orchestrator.stale_after_s
    )
    if nodes is not None:
        known = {n.node_id for n in nodes}
        for i, node_id in enumerate(body.node_ids or []):
            if node_id not in known:
                errors.append(
                    {
                        "loc": ["body", "node_ids", i],
                        "msg": f"no live Ray node {node_id!r}",
                        "type": "unknown_node",
                    }
                )
        chosen = [n for n in nodes if not body.node_ids or n.node_id in body.node_ids]
        problem = shape_problem(
            chosen,
            body.tensor_parallel_size,
            body.pipeline_parallel_size,
            resource=OrchestratorRepository(session).device_kind(
                settings.orchestrator.device_resource, settings.orchestrator.stale_after_s
            ),
        )
        if chosen and problem is not None:
            errors.append({"loc": ["body"], "msg": problem, "type": "shape_does_not_fit"})
    if body.model is not None:
        try:
            doc["model_path"] = str(service.resolve_model(settings, body.model).path)
        except SpecInvalidError as exc:
            errors += [{**e, "loc": ["body", "model"]} for e in exc.errors]
    if errors:
        raise ParityRequestInvalidError(
            errors, f"{len(errors)} problem(s) in the parity check request"
        )
    check = ParityCheckRepository(session).add(doc)
    session.commit()
    out = _parity_out(request, check)
    response.headers["Location"] = out.url
    return out


@router.get("/cluster/parity/{check_id}", response_model=ParityCheckOut)
def get_parity_check(check_id: str, request: Request, session: SessionDep) -> ParityCheckOut:
    """An on-demand parity check and, once done, its report."""
    check = ParityCheckRepository(session).get(check_id)
    if check is None:
        raise NotFoundError(f"no parity check {check_id}", code_hint="parity_check_not_found")
    return _parity_out(request, check)


def _fire_brief(sched: Schedule, fire: ScheduleFire) -> FireBrief:
    from orchestrator.schedules.service import zone

    return FireBrief(
        fire_time=fire.fire_time.astimezone(zone(sched.timezone)),
        status=fire.status,
        experiment_id=fire.experiment_id,
        detail=fire.detail,
    )


def _schedule_out(request: Request, session: Session, sched: Schedule) -> ScheduleOut:
    from orchestrator.schedules.service import NEXT_FIRES, next_fire_times

    now = utcnow()
    after = max(now, sched.last_fire_at) if sched.last_fire_at else now
    fires, _ = ScheduleRepository(session).fires(sched.id, limit=10, offset=0)
    return ScheduleOut(
        id=sched.id,
        url=str(request.url_for("get_schedule", schedule_id=sched.id)),
        fires_url=str(request.url_for("list_schedule_fires", schedule_id=sched.id)),
        name=sched.name,
        cron=sched.cron,
        timezone=sched.timezone,
        template=sched.template,
        enabled=sched.enabled,
        concurrency_policy=sched.concurrency_policy,
        catch_up=sched.catch_up,
        end_at=sched.end_at,
        created_at=sched.created_at,
        updated_at=sched.updated_at,
        created_by=sched.created_by,
        updated_by=sched.updated_by,
        last_fire_at=sched.last_fire_at,
        next_fire_times=(
            next_fire_times(sched.cron, sched.timezone, after, NEXT_FIRES, sched.end_at)
            if sched.enabled
            else []
        ),
        recent_fires=[_fire_brief(sched, f) for f in fires],
    )


@router.post("/schedules", status_code=201, response_model=ScheduleOut)
def create_schedule(
    body: ScheduleIn,
    request: Request,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
) -> ScheduleOut:
    """Store a scheduled sweep: ``template`` is submitted as an experiment at each fire time.

    422 problem+json: ``request_invalid`` for a bad field (an invalid ``cron``
    or ``timezone`` names the field and the value), ``schedule_invalid`` when
    the template fails experiment validation (locations under
    ``body.template``) or an ``end_at`` already past; 409 ``schedule_name_taken``.
    Nothing is stored then.
    """
    from orchestrator.schedules.service import save_schedule

    now = utcnow()
    if body.end_at is not None and body.end_at <= now:
        raise ScheduleInvalidError(
            [
                {
                    "loc": ["body", "end_at"],
                    "msg": f"end_at {body.end_at.isoformat()} is in the past: the schedule "
                    "would never fire",
                    "type": "end_at_past",
                }
            ]
        )
    if body.end_at is not None:
        from orchestrator.schedules.service import next_fire_times

        if not next_fire_times(body.cron, body.timezone, now, 1, body.end_at):
            raise ScheduleInvalidError(
                [
                    {
                        "loc": ["body", "cron"],
                        "msg": f"cron {body.cron!r} never fires before end_at "
                        f"{body.end_at.isoformat()}",
                        "type": "never_fires",
                    }
                ]
            )
    release_connection(session)
    with gate_for(settings).slot(), service.remembered_checks():
        catalog = load_catalog(settings)
        # vLLM's check with no connection held; the validation below reuses its answers
        service.precheck(settings, catalog, body.template)
        sched = save_schedule(session, settings, catalog, body.model_dump(), now=now)
    out = _schedule_out(request, session, sched)
    response.headers["Location"] = out.url
    return out


@router.get("/schedules", response_model=Page[ScheduleOut])
def list_schedules(
    request: Request, session: SessionDep, limit: Limit = 50, offset: Offset = 0
) -> Page[ScheduleOut]:
    """Schedules, newest first, each with its next fire times and latest fires."""
    rows, total = ScheduleRepository(session).page(limit=limit, offset=offset)
    items = [_schedule_out(request, session, s) for s in rows]
    return Page(items=items, total=total, limit=limit, offset=offset)


@router.get("/schedules/{schedule_id}", response_model=ScheduleOut)
def get_schedule(schedule_id: str, request: Request, session: SessionDep) -> ScheduleOut:
    """One schedule: its next 5 fire times (ISO 8601 in its zone) and its latest fires."""
    from orchestrator.schedules.service import get_schedule as get

    return _schedule_out(request, session, get(session, schedule_id))


@router.patch("/schedules/{schedule_id}", response_model=ScheduleOut)
def update_schedule(
    schedule_id: str,
    body: ScheduleUpdate,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
) -> ScheduleOut:
    """Change the given fields; the result is checked like a new schedule (422 / 409).

    Changing the timing or re-enabling restarts the fire times from now (time
    spent disabled is not caught up). A new template is checked by vLLM like a
    submission (503 ``submissions_busy`` when too many are being checked).
    """
    from orchestrator.schedules.service import get_schedule as get
    from orchestrator.schedules.service import save_schedule

    with contextlib.ExitStack() as checking:
        if body.template is not None:
            release_connection(session)
            checking.enter_context(gate_for(settings).slot())
            checking.enter_context(service.remembered_checks())
            service.precheck(settings, load_catalog(settings), body.template)
        sched = get(session, schedule_id)
        changes = body.model_dump(exclude_unset=True)
        current = {k: getattr(sched, k) for k in ScheduleIn.model_fields}
        try:
            merged = ScheduleIn.model_validate({**current, **changes})
        except ValidationError as exc:
            raise ScheduleInvalidError.from_validation(exc) from exc
        values = {k: getattr(merged, k) for k in changes}
        sched = save_schedule(
            session,
            settings,
            load_catalog(settings) if "template" in values else None,
            values,
            now=utcnow(),
            existing=sched,
        )
    return _schedule_out(request, session, sched)


@router.delete("/schedules/{schedule_id}", status_code=204)
def delete_schedule(schedule_id: str, session: SessionDep) -> Response:
    """Delete the schedule and its fire records; its experiments stay."""
    from orchestrator.schedules.service import get_schedule as get

    ScheduleRepository(session).delete(get(session, schedule_id))
    return Response(status_code=204)


@router.get("/schedules/{schedule_id}/fires", response_model=Page[FireOut])
def list_schedule_fires(
    schedule_id: str, session: SessionDep, limit: Limit = 20, offset: Offset = 0
) -> Page[FireOut]:
    """The schedule's fires, newest first, each with its regressions.

    A fired sweep whose runs are all terminal is compared with the previous
    completed sweep of the schedule, variant by variant (same name): a metric
    whose 95 % bootstrap interval lies on the bad side is a regression
    (:func:`orchestrator.schedules.service.sweep_regressions`; computed on read).
    """
    from orchestrator.schedules.service import get_schedule as get
    from orchestrator.schedules.service import sweep_regressions

    sched = get(session, schedule_id)
    rows, total = ScheduleRepository(session).fires(sched.id, limit=limit, offset=offset)
    items = []
    for f in rows:
        reg = sweep_regressions(session, f)
        items.append(FireOut(**_fire_brief(sched, f).model_dump(), **reg))
    return Page(items=items, total=total, limit=limit, offset=offset)


def _add_spec_schema(app: FastAPI) -> None:
    """Publish ``ExperimentSpec`` (and its parts) in the OpenAPI components."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = original()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        spec = dict(_SPEC_SCHEMA)
        for name, sub in spec.pop("$defs", {}).items():
            schemas.setdefault(name, sub)
        schemas["ExperimentSpec"] = spec
        app.openapi_schema = declare_problems(doc)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _probe_database(app: FastAPI) -> BaseException | None:
    """Run ``SELECT 1`` on a fresh connection (not the pool) in a thread of the health
    check's own limiter; the failure, or None."""
    import anyio

    if getattr(app.state, "health_limiter", None) is None:
        app.state.health_limiter = anyio.CapacityLimiter(2)
    bind = app.state.session_factory.kw.get("bind")
    if getattr(app.state, "health_engine", None) is None and isinstance(bind, Engine):
        app.state.health_engine = create_engine(
            bind.url, poolclass=NullPool, connect_args={"connect_timeout": 3}
        )

    def probe() -> BaseException | None:
        try:
            engine: Engine | None = getattr(app.state, "health_engine", None)
            if engine is not None:
                with engine.connect() as conn:
                    conn.execute(text("SELECT 1"))
            else:
                with app.state.session_factory() as s:
                    s.execute(text("SELECT 1"))
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return exc
        return None

    result: BaseException | None = await anyio.to_thread.run_sync(
        probe, limiter=app.state.health_limiter
    )
    return result


def create_app(settings: Settings, session_factory: sessionmaker[Session]) -> FastAPI:
    app = FastAPI(
        docs_url=None,  # served below from the vendored Swagger UI (no CDN)
        redoc_url=None,
        openapi_url=None,  # served by api.auth.install (a viewer may read it)
        title="vlab",
        version="0.1.0",
        description="Controlled, one-variable-at-a-time experiments on vLLM, run through Ray.",
    )
    app.state.settings = settings
    app.state.session_factory = session_factory
    if isinstance(session_factory.kw.get("bind"), Engine):
        watch(session_factory.kw["bind"])  # successful checkouts end a database outage
    problems.install(app)
    auth.install(app)
    limits.install(app, settings)  # outermost: refuses large bodies before anything reads them
    app.include_router(router, dependencies=auth.API_AUTH)
    _add_spec_schema(app)

    @app.get("/docs", include_in_schema=False, dependencies=auth.PAGE_AUTH)
    def swagger_ui() -> Response:
        """Swagger UI for ``/openapi.json`` from ``web/static/vendor/swagger-ui``
        (swagger-ui-dist 5.35.0), so the API docs work offline too."""
        from fastapi.openapi.docs import get_swagger_ui_html

        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="vlab API",
            swagger_js_url="/static/vendor/swagger-ui/swagger-ui-bundle.js",
            swagger_css_url="/static/vendor/swagger-ui/swagger-ui.css",
            swagger_favicon_url="/static/vendor/swagger-ui/favicon-32x32.png",
        )

    @app.get("/healthz")
    async def healthz(request: Request) -> Response:
        """200 ``{"status": "ok", "database": "ok"}`` when the database answers ``SELECT 1``;
        else 503 problem+json ``database_unavailable`` with ``"database": "down"`` and
        ``down_since`` (ISO 8601). Probed on its own connection and thread (limiter), so
        it answers in milliseconds even when every request thread and pooled connection
        is busy."""
        failure = await _probe_database(request.app)
        if failure is None:
            database_health.ok()
            return JSONResponse({"status": "ok", "database": "ok"})
        database_health.failed(failure, "healthz")
        since = database_health.down_since
        return problems.problem(
            request,
            503,
            "database_unavailable",
            "Database unavailable",
            "the database cannot be reached; the API answers 503 until it is back",
            retry_after_s=problems.DATABASE_RETRY_AFTER_S,
            database="down",
            down_since=datetime.fromtimestamp(since, UTC).isoformat() if since else None,
        )

    from api.routes.analyze import findings_router
    from api.routes.analyze import router as analyze_router
    from web.pages import build_router

    app.include_router(analyze_router, dependencies=auth.API_AUTH)
    app.include_router(findings_router, dependencies=auth.API_AUTH)

    app.include_router(build_router())
    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
    return app
