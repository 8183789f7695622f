"""The dashboard: server-rendered HTML pages (Jinja2 templates in ``web/templates``,
rendered by :mod:`web.render`) with charts and live updates done in the browser from
the ``/api/v1`` JSON.

Pages: ``/`` run history, ``/experiments/{id}``, ``/runs/{id}``, ``/compare?run=...``,
``/schedules``, ``/campaigns``; ``/login`` (:mod:`web.pages.login`) signs in with an API token when
tokens exist. Static assets are served from ``/static`` and all ship in
``web/static`` (Chart.js and its error-bar plugin are vendored in
``web/static/vendor``; no CDN, no web font).
"""

from __future__ import annotations

from fastapi import APIRouter

from api.auth import PAGE_AUTH
from web.pages import campaigns, compare, experiment, history, login, run, schedules


def build_router() -> APIRouter:
    """All dashboard pages (kept out of the OpenAPI document), each behind the sign-in
    (:data:`api.auth.PAGE_AUTH`: viewer or above, else a redirect to ``/login``), and
    the sign-in pages themselves (open to anyone)."""
    pages = APIRouter(dependencies=PAGE_AUTH)
    for module in (history, experiment, run, compare, schedules, campaigns):
        pages.include_router(module.router)
    router = APIRouter(include_in_schema=False)
    router.include_router(login.router)
    router.include_router(pages)
    return router
