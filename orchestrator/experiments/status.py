"""An experiment's aggregate status and its server reuse, read from its runs.

Shared by the JSON API (``GET /api/v1/experiments``) and the dashboard pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orchestrator.core.models import Run
from orchestrator.core.states import ACTIVE, RunStatus


def experiment_status(runs: Sequence[Run]) -> str:
    """Aggregate status: queued, running, succeeded, failed or cancelled."""
    statuses = {r.status for r in runs}
    if not statuses or statuses == {RunStatus.QUEUED.value}:
        return "queued"
    if statuses & ACTIVE:
        return "running"
    if statuses == {RunStatus.SUCCEEDED.value}:
        return "succeeded"
    if statuses & {RunStatus.FAILED.value, RunStatus.BLOCKED.value}:
        return "failed"
    return "cancelled"


def server_reuse(runs: Sequence[Run]) -> dict[str, Any]:
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
