"""Response schemas of the REST API (requests use :class:`orchestrator.spec.ExperimentSpec`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")


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
    progress: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    model_id: str
    model_path: str
    model_digest: str
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
    metrics: dict[str, float] | None = None


class ExperimentOut(BaseModel):
    id: str
    url: str
    name: str
    description: str | None
    model_id: str
    model_digest: str
    request_list_hash: str
    created_at: datetime
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
    tensor_parallel_size: int = Field(1, ge=1, le=1024)
    pipeline_parallel_size: int = Field(1, ge=1, le=1024)


class ParityCheckOut(BaseModel):
    id: str
    url: str
    status: str = Field(description="pending, running, done or failed")
    created_at: datetime
    finished_at: datetime | None
    request: dict[str, Any]
    report: dict[str, Any] | None = Field(
        None, description="orchestrator.parity.check_parity report: verdict, per-field values"
    )
    error: str | None


class RunParityOut(BaseModel):
    run_id: str
    status: str
    placement: dict[str, Any] | None
    report: dict[str, Any]
