"""``/healthz``: is the service up and does the database answer (no sign-in needed)."""

from __future__ import annotations

from datetime import UTC, datetime

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import Engine, create_engine
from sqlalchemy.pool import NullPool

from api import problems
from orchestrator.core.db import database_health
from orchestrator.core.repositories import ping

router = APIRouter(tags=["health"])


async def _probe_database(app: FastAPI) -> BaseException | None:
    """Run ``SELECT 1`` on a fresh connection (not the pool) in a thread of the health
    check's own limiter; the failure, or None."""
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
                    ping(conn)
            else:
                with app.state.session_factory() as s:
                    ping(s)
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return exc
        return None

    result: BaseException | None = await anyio.to_thread.run_sync(
        probe, limiter=app.state.health_limiter
    )
    return result


@router.get("/healthz")
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
