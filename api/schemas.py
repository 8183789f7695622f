"""Response schemas of the REST API.

Requests use :class:`orchestrator.experiments.spec.ExperimentSpec`.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, field_validator
from pydantic_core import PydanticCustomError

from jobs.capacity.search import CapacityResult
from jobs.signals.engineevents import EVENT_TYPES
from orchestrator.schedules.cron import check_cron, zone

T = TypeVar("T")


def _iso_only(value: Any) -> Any:
    """Refuse numbers (and numeric strings) as date-times: the API takes ISO 8601 text, as
    its OpenAPI description says; pydantic alone reads ``0.5`` as a Unix time."""
    if isinstance(value, int | float) or (
        isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+(\.\d*)?\s*", value)
    ):
        raise ValueError("expected an ISO 8601 date-time, e.g. 2026-12-01T09:00:00Z")
    return value


#: A date-time given as ISO 8601 text only.
IsoDatetime = Annotated[datetime, BeforeValidator(_iso_only)]


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int


class RunBrief(BaseModel):
    id: str
    name: str
    position: int
    repeat_index: int
    sequence: int
    status: str
    url: str


class ExperimentCreated(BaseModel):
    id: str
    url: str
    runs: list[RunBrief]
    capacity_estimate: dict[str, Any] | None = Field(
        None,
        description="a capacity experiment: the longest its searches can take, in seconds "
        "(steps_max, step_s_max, drain_s_max, run_s_max, runs, experiment_s_max, note)",
    )


class RunOut(BaseModel):
    id: str
    url: str
    experiment_id: str
    name: str
    position: int
    is_baseline: bool
    reference_run_id: str | None
    reference_variant: str | None
    variable: str | None
    variable_paths: list[str]
    changes: dict[str, Any]
    repeat_index: int
    sequence: int
    server_key: str | None
    resolved_config: dict[str, Any] | None
    status: str
    status_reason: str | None
    cancel_requested: bool
    submitted_by: str | None = Field(
        None, description="who queued the run: a token name, 'anonymous' or 'schedule:<name>'"
    )
    cancelled_by: str | None = Field(None, description="who asked to cancel the run")
    progress: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    model_id: str
    model_path: str
    model_digest: str
    model_revision: str | None = Field(
        None, description="Hugging Face snapshot commit of a model named by id (else null)"
    )
    max_model_len: int | None
    seed: int
    request_list_hash: str
    vllm_version: str | None
    layout: dict[str, Any]
    workload: dict[str, Any]
    explicit_engine_args: dict[str, Any]
    engine_args: dict[str, Any]
    engine_info: dict[str, Any]
    timings: dict[str, Any]
    error: str | None
    partial: bool
    placement: dict[str, Any] | None = Field(
        None, description="the layout the run got: nodes, ranks, devices, exclusive policy"
    )
    capacity: CapacityResult | None = Field(
        None,
        description="the run's capacity search under SLOs (every step, the boundary and its "
        "interval, the binding SLO); null when the experiment has no capacity search or the "
        "run has not finished",
    )
    metrics: dict[str, float] | None = None


class ExperimentOut(BaseModel):
    id: str
    url: str
    name: str
    description: str | None
    model_id: str
    model_digest: str
    model_revision: str | None = Field(
        None, description="Hugging Face snapshot commit of a model named by id (else null)"
    )
    request_list_hash: str
    created_at: datetime
    submitted_by: str | None = Field(
        None, description="who submitted it: a token name, 'anonymous' or 'schedule:<name>'"
    )
    status: str
    repeats: int
    server_reuse: dict[str, Any] = Field(
        description="runs that reused a running vLLM server and the start-up seconds saved"
    )
    variants: list[dict[str, Any]] = Field(
        description="the chain: each variant's reference, the variable it changes, its changes"
    )
    spec: dict[str, Any]
    runs: list[RunOut]


class ExperimentListItem(BaseModel):
    id: str
    url: str
    name: str
    model_id: str
    created_at: datetime
    status: str
    run_count: int


class SampleOut(BaseModel):
    t_s: float
    phase: str
    values: dict[str, float]


class RunMetricsOut(BaseModel):
    run_id: str
    status: str
    partial: bool = Field(description="the run ended early; these are the numbers measured")
    metrics: dict[str, float]
    samples: list[SampleOut]
    samples_total: int = Field(description="samples stored (before downsampling)")


#: The engine event vocabulary (type -> meaning), for the API and the dashboard.
ENGINE_EVENT_TYPES: dict[str, str] = EVENT_TYPES


class EngineEventOut(BaseModel):
    """A typed event of the engine log (:data:`jobs.signals.engineevents.EVENT_KEYS`)."""

    type: str = Field(description="one of the response's `types`")
    time: str | None = Field(None, description="the record's time as logged (None: none)")
    t_s: float | None = Field(
        None, description="seconds since the run began (the charts' x); None when unplaced"
    )
    placement: Literal["placed", "unplaced"]
    after_t_s: float | None = Field(
        None, description="unplaced: t_s of the last timed record before it (a lower bound)"
    )
    placement_note: str | None = None
    level: str | None = None
    source: str | None = Field(None, description="process or Ray actor name of the line's tag")
    pid: int | None = None
    node_ip: str | None = None
    message: str
    line: int = Field(description="1-based line in the engine log")
    count: int | None = Field(None, description="the same event logged this many times")
    repeat_count: int | None = Field(None, description="Ray's [repeated Nx across cluster]")
    merged_across_processes: bool | None = Field(
        None, description="Ray merged several processes' lines into this one"
    )
    details: dict[str, Any] | None = None
    notes: list[str] | None = Field(
        None, description="what was joined or left out (a figure a wrap may have cut)"
    )


class EngineEventsSummary(BaseModel):
    total: int = Field(description="events of the run, before the per-run cap")
    kept: int = Field(description="events stored")
    by_type: dict[str, int]
    unplaced: int


class RunEventsOut(BaseModel):
    """``GET /runs/{id}/events``: the run's engine events, a page of them."""

    run_id: str
    status: str
    recorded: bool = Field(
        description="the run stored engine events; false: unknown (run not ended, recorded "
        "before events were read, or no server ran), not 'no events'"
    )
    types: dict[str, str] = Field(description="the event vocabulary: type -> meaning")
    summary: EngineEventsSummary | None
    stats_notes: list[dict[str, Any]] = Field(
        default_factory=list, description="stats lines of the run dropped or ignored, and why"
    )
    items: list[EngineEventOut]
    total: int = Field(description="events matching the filters")
    limit: int
    offset: int


class RequestOut(BaseModel):
    seq: int
    request_index: int
    warmup: bool
    request_class: str | None
    success: bool
    error: str | None
    start_s: float
    ttft_s: float | None
    tpot_s: float | None
    e2el_s: float | None
    itl_s: list[float]
    prompt_tokens: int | None
    output_tokens: int | None
    cached_tokens: int | None
    scheduled_s: float | None
    conversation: int | None
    turn: int | None


class ParityCheckRequest(BaseModel):
    """``POST /api/v1/cluster/parity``: compare the environments of a set of Ray nodes."""

    model_config = ConfigDict(extra="forbid")

    node_ids: list[str] | None = Field(
        None, min_length=1, max_length=1024, description="Ray node ids; default every live node"
    )
    model: str | None = Field(
        None, min_length=1, max_length=500, description="model whose files are compared"
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="the engine arguments each node would launch with"
    )
    tensor_parallel_size: int = Field(1, ge=1, le=1024, strict=True)
    pipeline_parallel_size: int = Field(1, ge=1, le=1024, strict=True)


class ParityCheckOut(BaseModel):
    id: str
    url: str
    status: str = Field(description="pending, running, done or failed")
    created_at: datetime
    finished_at: datetime | None
    request: dict[str, Any]
    report: dict[str, Any] | None = Field(
        None,
        description="orchestrator.cluster.parity.check_parity report: verdict (ok, blocked "
        "or unknown), verdict_reasons, per-field values",
    )
    error: str | None


class RunParityOut(BaseModel):
    run_id: str
    status: str
    placement: dict[str, Any] | None
    report: dict[str, Any]


class ScheduleIn(BaseModel):
    """A scheduled sweep (``POST /api/v1/schedules``).

    ``cron``: 5-field cron expression, evaluated in ``timezone`` (IANA name).
    ``template``: an experiment spec, as ``POST /api/v1/experiments`` takes.
    ``concurrency_policy``: ``skip`` a fire while the previous sweep has
    unfinished runs, or ``queue`` it anyway. ``catch_up`` after downtime:
    ``latest`` runs the most recent missed fire once, ``none`` skips them all.
    ``end_at``: no fires after it (a naive value is taken as UTC).
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    cron: str = Field(max_length=200, json_schema_extra={"pattern": r"^\s*\S+(\s+\S+){4}\s*$"})
    timezone: str = Field("UTC", max_length=64)
    template: dict[str, Any]
    enabled: StrictBool = True
    concurrency_policy: Literal["skip", "queue"] = "skip"
    catch_up: Literal["latest", "none"] = "latest"
    end_at: IsoDatetime | None = None

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str) -> str:
        try:
            return check_cron(v)
        except ValueError as exc:
            raise PydanticCustomError("cron_invalid", str(exc)) from exc

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        try:
            zone(v)
        except ValueError as exc:
            raise PydanticCustomError("timezone_invalid", str(exc)) from exc
        return v

    @field_validator("end_at")
    @classmethod
    def _aware(cls, v: datetime | None) -> datetime | None:
        return v.replace(tzinfo=UTC) if v is not None and v.tzinfo is None else v


class ScheduleUpdate(BaseModel):
    """A partial update (``PATCH``): only the fields given change; same rules as ScheduleIn."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=200)
    cron: str | None = Field(
        None, max_length=200, json_schema_extra={"pattern": r"^\s*\S+(\s+\S+){4}\s*$"}
    )
    timezone: str | None = Field(None, max_length=64)
    template: dict[str, Any] | None = None
    enabled: StrictBool | None = None
    concurrency_policy: Literal["skip", "queue"] | None = None
    catch_up: Literal["latest", "none"] | None = None
    end_at: IsoDatetime | None = None


class FireBrief(BaseModel):
    """A fire time (in the schedule's zone) and what happened: fired, skipped,
    skipped_busy or failed."""

    fire_time: datetime
    status: str
    experiment_id: str | None
    detail: str | None


class Regression(BaseModel):
    """A metric that got worse than in the previous completed sweep (95 % interval).

    Capacity: ``reference_value`` / ``value`` are the mean capacities, None where a sweep
    found only a bound (``at least``/``below``); then the interval is one-sided (``ci_low``
    None) and ``statement`` says it with the bounds (``lower: at most 0.25x (at least 24
    -> below 6 requests/s)``)."""

    variant: str
    metric: str
    unit: str
    reference_value: float | None
    value: float | None
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    ci_of: str | None
    statement: str | None = None


class Withheld(BaseModel):
    """A metric the regression check gave no verdict on: a flag of a compared run taints
    it (token bursts, a warm prefix cache: ``orchestrator.analysis.trust``)."""

    variant: str
    metric: str
    reason: str | None


class FireOut(FireBrief):
    """A fire with its regression check against the previous completed sweep.

    ``comparison``: ``not_fired``, ``pending`` (runs unfinished), ``no_previous``
    or ``compared``.
    """

    comparison: str
    compared_with: dict[str, Any] | None
    regressions: list[Regression]
    withheld: list[Withheld] = Field(
        default_factory=list,
        description="metrics with no verdict: flagged untrustworthy for a compared run",
    )


class ScheduleOut(BaseModel):
    id: str
    url: str
    fires_url: str
    name: str
    cron: str
    timezone: str
    template: dict[str, Any]
    enabled: bool
    concurrency_policy: str
    catch_up: str
    end_at: datetime | None
    created_at: datetime
    updated_at: datetime
    created_by: str | None = Field(None, description="the token name that created it")
    updated_by: str | None = Field(None, description="the token name that last changed it")
    last_fire_at: datetime | None
    next_fire_times: list[datetime] = Field(
        description="the next 5 fire times, in the schedule's time zone"
    )
    recent_fires: list[FireBrief] = Field(description="the latest 10 fires, newest first")


class MlflowExportRequest(BaseModel):
    """``POST /api/v1/experiments/{id}/export/mlflow``: where to export the runs."""

    model_config = ConfigDict(extra="forbid")

    tracking_uri: str | None = Field(
        None,
        min_length=1,
        max_length=2000,
        description="the MLflow tracking server, e.g. https://mlflow.example.com (default "
        "VLAB_MLFLOW__TRACKING_URI); http(s) only unless VLAB_MLFLOW__ALLOW_LOCAL_STORES",
    )
    experiment_name: str | None = Field(
        None,
        min_length=1,
        max_length=500,
        description="the MLflow experiment (default: the vlab experiment's name)",
    )
    include_failed: StrictBool = Field(
        True, description="export failed, cancelled and blocked runs (without summary metrics)"
    )
    replace: StrictBool = Field(
        False, description="delete the MLflow runs an earlier export made and export anew"
    )
    max_points: int | None = Field(
        None,
        ge=1,
        le=100_000,
        strict=True,
        description="at most this many time-series points per run (default: every sample)",
    )


class MlflowRunExportOut(BaseModel):
    run_id: str
    variant: str
    repeat_index: int
    status: str
    action: Literal[
        "created", "replaced", "unchanged", "skipped_not_finished", "skipped_not_succeeded"
    ]
    mlflow_run_id: str | None
    params: int
    metrics: int = Field(description="summary metrics written (none for a run that failed)")
    series_points: int = Field(description="time-series points written as metric history")
    unknown_metrics: list[str] = Field(
        description="compared metrics the run lacks or holds as non-finite: not written"
    )


class MlflowExportOut(BaseModel):
    experiment_id: str
    tracking_uri: str = Field(description="where it went (without user name or password)")
    mlflow_experiment_name: str
    mlflow_experiment_id: str
    counts: dict[str, int] = Field(description="runs per action")
    runs: list[MlflowRunExportOut]
