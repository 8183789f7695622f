"""``/api/v1/runs``: the run history, one run with its metrics, request records, engine
log and engine events, a new variant cloned from a run, cancelling, the run's parity
report."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse

from api.deps import SessionDep, SettingsDep
from api.routes.common import Limit, Offset, run_brief, run_out
from api.schemas import (
    EngineEventOut,
    EngineEventsSummary,
    IsoDatetime,
    Page,
    RequestOut,
    RunBrief,
    RunEventsOut,
    RunMetricsOut,
    RunOut,
    RunParityOut,
    SampleOut,
    VariantIn,
)
from jobs.signals.engineevents import EVENT_TYPES
from jobs.signals.enginelog import filter_noise
from orchestrator.core.errors import NotFoundError, QueryInvalidError
from orchestrator.core.repositories import RunRepository
from orchestrator.core.states import RunStatus
from orchestrator.experiments import service
from orchestrator.experiments.intake import accept_variant
from orchestrator.runs.history import (
    HistoryFilter,
    HistoryQueryError,
    history_page,
    parse_engine_arg,
)
from orchestrator.runs.logs import engine_log_from_disk
from orchestrator.runs.service import request_cancel
from orchestrator.runs.timeseries import downsample

router = APIRouter(prefix="/api/v1", tags=["runs"])

#: ``sort`` of ``GET /runs``: :data:`orchestrator.runs.history.SORT_KEYS`, spelled out so
#: the OpenAPI document lists them (tests/api/test_openapi_enums.py keeps them equal).
SortKey = Literal[
    "submitted",
    "sequence",
    "started",
    "duration",
    "experiment",
    "model",
    "status",
    "variable",
    "ttft_p50",
    "ttft_p99",
    "e2el_p50",
    "output_throughput",
    "hit_rate",
]
#: ``type`` of ``GET /runs/{id}/events``: :data:`jobs.signals.engineevents.EVENT_TYPES` (same test).
EventType = Literal[
    "out_of_memory",
    "nccl_error",
    "gloo_error",
    "engine_dead",
    "worker_died",
    "unhealthy",
    "health_check_failed",
    "preemption",
    "restart",
]


def _next_url(request: Request, cursor: str | None) -> str | None:
    """This request's URL with ``cursor`` (and no ``offset``): the next page."""
    if not cursor:
        return None
    keep = [(k, v) for k, v in request.query_params.multi_items() if k not in ("cursor", "offset")]
    return f"{request.url.path}?{urlencode([*keep, ('cursor', cursor)])}"


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
        SortKey | None,
        Query(description="default: sequence with experiment_id, else submitted"),
    ] = None,
    order: Literal["asc", "desc"] | None = None,
    limit: Limit = 50,
    offset: Offset = 0,
    cursor: Annotated[
        str | None,
        Query(
            max_length=2000,
            description="the previous page's `next_cursor`: the page after it (with the same "
            "filters, sort and order), as fast at any depth; `offset` then skips from there",
        ),
    ] = None,
) -> Page[RunOut]:
    """The run history: filtered, sorted, paginated (the dashboard's first page uses the
    same query, :func:`orchestrator.runs.history.history_page`). Runs without the sort value
    (e.g. no metric yet) come last; `submitted` (the default) is the newest experiment
    first, its runs together in start order. Pages: follow `next` (this URL with `cursor`
    = `next_cursor`, a keyset cursor: the same cost at any depth; null on the last page)
    or step `offset`. `total` is exact up to 1,000 runs, above estimated (`total_estimated`)."""
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
            session,
            flt,
            sort=key,
            descending=descending,
            limit=limit,
            offset=offset,
            cursor=cursor,
        )
    except HistoryQueryError as exc:
        raise QueryInvalidError(exc.field, str(exc)) from None
    return Page(
        items=[run_out(request, row.run, row.run_metrics or None) for row in page.rows],
        total=page.total,
        limit=limit,
        offset=offset,
        total_estimated=page.estimated,
        next_cursor=page.next_cursor,
        next=_next_url(request, page.next_cursor),
    )


@router.get("/runs/{run_id}", response_model=RunOut)
def get_run(run_id: str, request: Request, session: SessionDep) -> RunOut:
    run = service.get_run(session, run_id)
    return run_out(request, run, RunRepository(session).metrics(run_id))


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


@router.get("/runs/{run_id}/events", response_model=RunEventsOut)
def get_run_events(
    run_id: str,
    session: SessionDep,
    limit: Limit = 100,
    offset: Offset = 0,
    type: Annotated[  # noqa: A002 - the field's name
        EventType | None, Query(description="one event type")
    ] = None,
    placement: Literal["placed", "unplaced"] | None = None,
) -> RunEventsOut:
    """The run's engine events (out of memory, NCCL/Gloo errors, engine or worker died,
    unhealthy, failed health checks, preemptions, restarts) in log order, with their
    time on the run's clock (``t_s``, the x of the time-series charts) or
    ``placement: "unplaced"`` when the log's time cannot be mapped
    (:mod:`jobs.signals.engineevents`). ``recorded`` false: the run stored none (unknown, not
    "no events"). 422 for an unknown ``type``."""
    run = service.get_run(session, run_id)
    info = run.engine_info or {}
    stored = info.get("engine_events")
    events = [e for e in stored if isinstance(e, dict)] if isinstance(stored, list) else []
    if type is not None:
        events = [e for e in events if e.get("type") == type]
    if placement is not None:
        events = [e for e in events if e.get("placement") == placement]
    summary = info.get("engine_events_summary")
    notes = info.get("stats_notes")
    return RunEventsOut(
        run_id=run.id,
        status=run.status,
        recorded=isinstance(stored, list),
        types=EVENT_TYPES,
        summary=EngineEventsSummary.model_validate(summary) if isinstance(summary, dict) else None,
        stats_notes=[n for n in notes if isinstance(n, dict)] if isinstance(notes, list) else [],
        items=[EngineEventOut.model_validate(e) for e in events[offset : offset + limit]],
        total=len(events),
        limit=limit,
        offset=offset,
    )


@router.get(
    "/runs/{run_id}/log",
    response_class=PlainTextResponse,
    responses={
        200: {
            "description": "The engine log (text/plain; UTF-8)",
            "headers": {
                "X-Noise-Lines-Dropped": {
                    "description": "probe lines the filter removed (0 with `raw`)",
                    "schema": {"type": "integer", "minimum": 0},
                }
            },
        }
    },
)
def get_run_log(run_id: str, session: SessionDep, raw: bool = False) -> PlainTextResponse:
    """The engine log captured for the run (text/plain).

    By default successful ``/health``, ``/metrics`` and ``/ping`` probe lines
    are filtered out (a failing probe stays); ``?raw=1`` returns the whole
    log. ``X-Noise-Lines-Dropped`` says how many lines the filter removed.
    """
    run = service.get_run(session, run_id)
    content = RunRepository(session).log(run_id)
    if content is None:  # running, or lost before its end: the log file on disk
        content = engine_log_from_disk(run)
    if content is None:
        raise NotFoundError(f"run {run_id} has no engine log yet", code_hint="log_not_found")
    dropped = 0
    if not raw:
        content, dropped = filter_noise(content)
    return PlainTextResponse(content, headers={"X-Noise-Lines-Dropped": str(dropped)})


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
    runs = accept_variant(session, settings, run_id, body.name, body.changes)
    return [run_brief(request, r) for r in runs]


@router.post("/runs/{run_id}/cancel", response_model=RunOut, status_code=202)
def cancel_run(run_id: str, request: Request, session: SessionDep) -> RunOut:
    """Cancel a run: queued runs end at once; active ones are stopped by their orchestrator."""
    return run_out(request, request_cancel(session, run_id))


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
