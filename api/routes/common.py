"""What several routers share: the pagination parameters and a run's JSON shape."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query, Request

from api.schemas import RunBrief, RunOut
from orchestrator.core.models import Run

Limit = Annotated[int, Query(ge=1, le=500)]
Offset = Annotated[int, Query(ge=0, le=10**12)]


def run_url(request: Request, run_id: str) -> str:
    return str(request.url_for("get_run", run_id=run_id))


def run_brief(request: Request, r: Run) -> RunBrief:
    return RunBrief(
        id=r.id,
        name=r.name,
        position=r.position,
        repeat_index=r.repeat_index,
        sequence=r.sequence,
        status=r.status,
        url=run_url(request, r.id),
    )


def run_out(request: Request, run: Run, metrics: dict[str, float] | None = None) -> RunOut:
    data: dict[str, Any] = {k: getattr(run, k) for k in RunOut.model_fields if hasattr(run, k)}
    data["url"] = run_url(request, run.id)
    data["metrics"] = metrics
    return RunOut.model_validate(data)
