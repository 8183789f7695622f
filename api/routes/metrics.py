"""``GET /metrics``: the service's own metrics in the Prometheus exposition format.

The series and what each means: :mod:`orchestrator.core.telemetry` and
docs/OPERATIONS.md ("The service's own metrics"). Rendered by ``prometheus_client``
(text format 0.0.4, or OpenMetrics when the scraper asks for it in ``Accept``).

**Auth.** Like ``/healthz``, open by default: a scraper has no user token, and the
series hold counts and timings only (no names, specs, logs or tokens). With
``VLAB_API__METRICS_TOKEN`` set, a scrape needs ``Authorization: Bearer <that token>``
(401 problem+json ``unauthenticated`` otherwise); it is compared in constant time and
without the database, so the scrape still answers during a database outage (with
``vlab_database_up 0``), which a check of the API's own tokens (stored in the database)
could not. Not in ``/openapi.json``: it is not part of the JSON API.
"""

from __future__ import annotations

import hmac

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from api import problems
from orchestrator.core.telemetry import scrape_registry

router = APIRouter(tags=["metrics"])


def _registry(app: FastAPI) -> CollectorRegistry:
    registry: CollectorRegistry | None = getattr(app.state, "metrics_registry", None)
    if registry is None:
        registry = app.state.metrics_registry = scrape_registry(app.state.session_factory)
    return registry


def _authorized(request: Request) -> bool:
    secret = request.app.state.settings.api.metrics_token
    if secret is None:
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    expected = secret.get_secret_value().encode()
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """The exposition of :func:`orchestrator.core.telemetry.scrape_registry`, read in a
    thread of its own limiter (the database queries block), so a scrape answers even
    when every request thread is busy."""
    if not _authorized(request):
        resp = problems.problem(
            request,
            401,
            "unauthenticated",
            "Unauthenticated",
            "this scrape needs the metrics token: send Authorization: Bearer "
            "<VLAB_API__METRICS_TOKEN>",
        )
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp
    app = request.app
    if getattr(app.state, "metrics_limiter", None) is None:
        app.state.metrics_limiter = anyio.CapacityLimiter(2)
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    registry = _registry(app)
    body: bytes = await anyio.to_thread.run_sync(
        encoder, registry, limiter=app.state.metrics_limiter
    )
    return Response(body, media_type=content_type)
