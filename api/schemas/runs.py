"""Bodies of ``/api/v1/runs``: a run, its metrics, request records, engine events and
parity report, and a variant cloned from a run.

A run's ``capacity`` is :class:`jobs.capacity.search.CapacityResult`: the search in
``jobs`` writes it and its JSON is stored as it is (``runs.capacity``), so the API
publishes that one model rather than a copy that could drift (re-exported here).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jobs.capacity.search import CapacityResult
from jobs.signals.engineevents import EVENT_TYPES
from orchestrator.experiments.spec import CHANGES_SCHEMA, NAME_PATTERN


class RunBrief(BaseModel):
    id: str
    name: str
    position: int
    repeat_index: int
    sequence: int
    status: str
    url: str


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
    campaign_id: str | None = Field(
        None, description="the tuning campaign that queued the run (/api/v1/campaigns/{id})"
    )
    campaign_label: str | None = Field(
        None, description="its label in that campaign, e.g. r1.c2.engine_args.max_num_seqs=64"
    )
    submitted_by: str | None = Field(
        None, description="who queued the run: a token name, 'anonymous' or 'schedule:<name>'"
    )
    cancelled_by: str | None = Field(None, description="who asked to cancel the run")
    progress: dict[str, Any]
    created_at: datetime
    claimed_at: datetime | None = Field(
        None,
        description="when a dispatcher claimed the run and reserved its devices (its "
        "engine's start-up and warm-up follow; null until claimed)",
    )
    started_at: datetime | None = Field(
        None, description="when its warm-up began (after the engine's start-up)"
    )
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


class RunParityOut(BaseModel):
    run_id: str
    status: str
    placement: dict[str, Any] | None
    report: dict[str, Any]


class VariantIn(BaseModel):
    """A new variant cloned from a run with exactly one change."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    changes: dict[str, Any] = Field(min_length=1, json_schema_extra=CHANGES_SCHEMA)
