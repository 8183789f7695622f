"""Bodies of ``/api/v1/cluster/parity``: an on-demand node parity check."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


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
