"""The application factory: middleware, problem+json handlers, the OpenAPI document,
the ``/api/v1`` routers (:mod:`api.routes`), ``/healthz``, ``/metrics`` and the dashboard
(:mod:`web.pages`, static assets from ``web/static``)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from api import auth, limits, openapi, problems
from api.routes import (
    analyze,
    campaigns,
    cluster,
    docs,
    experiments,
    health,
    metrics,
    runs,
    schedules,
)
from api.routes import auth as auth_routes
from orchestrator.core.db import watch
from orchestrator.core.settings import Settings
from web.pages import build_router
from web.render import STATIC, error_page

#: The ``/api/v1`` routers, each tagged; every one is included with :data:`api.auth.API_AUTH`.
API_ROUTERS = (
    auth_routes.router,
    experiments.router,
    runs.router,
    cluster.router,
    schedules.router,
    campaigns.router,
    analyze.router,
    analyze.findings_router,
)


def create_app(settings: Settings, session_factory: sessionmaker[Session]) -> FastAPI:
    app = FastAPI(
        docs_url=None,  # served by api.routes.docs from the vendored Swagger UI (no CDN)
        redoc_url=None,
        openapi_url=None,  # served by api.routes.docs (a viewer may read it)
        title="vlab",
        version="0.1.0",
        description="Controlled, one-variable-at-a-time experiments on vLLM, run through Ray.",
    )
    app.state.settings = settings
    app.state.session_factory = session_factory
    if isinstance(session_factory.kw.get("bind"), Engine):
        watch(session_factory.kw["bind"])  # successful checkouts end a database outage
    problems.install(app, error_page=error_page)  # dashboard pages get an HTML error page
    auth.install(app)
    limits.install(app, settings)  # outermost: refuses large bodies before anything reads them
    openapi.install(app)
    for router in API_ROUTERS:
        app.include_router(router, dependencies=auth.API_AUTH)
    app.include_router(docs.router)
    app.include_router(health.router)
    app.include_router(metrics.router)  # open, or VLAB_API__METRICS_TOKEN (api.routes.metrics)
    app.include_router(build_router())
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
