"""The dashboard: server-rendered HTML pages (Jinja2 templates in ``web/templates``)
with charts and live updates done in the browser from the ``/api/v1`` JSON.

Pages: ``/`` run history, ``/experiments/{id}``, ``/runs/{id}``, ``/compare?run=...``,
``/schedules``; ``/login`` (:mod:`api.auth`) signs in with an API token when tokens
exist. Static assets are served from ``/static`` and all ship in
``web/static`` (Chart.js and its error-bar plugin are vendored in
``web/static/vendor``; no CDN, no web font).
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from jinja2 import Undefined

WEB = Path(__file__).resolve().parent.parent
TEMPLATES = Jinja2Templates(directory=WEB / "templates")


def fmt_num(value: Any, digits: int = 1) -> str:
    """A number with ``digits`` decimals and thousands separators; ``–`` when missing."""
    if value is None or isinstance(value, Undefined):
        return "–"
    if isinstance(value, float) and not math.isfinite(value):
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    try:
        return f"{float(value):,.{digits}f}"
    except (TypeError, ValueError):
        return str(value)


def fmt_pct(value: Any, digits: int = 1) -> str:
    """A fraction (0..1) as a percentage; ``–`` when missing."""
    if value is None or isinstance(value, Undefined):
        return "–"
    return f"{float(value) * 100:.{digits}f} %"


def fmt_duration(seconds: float | None) -> str:
    """Seconds as ``42 s``, ``3 min 05 s`` or ``2 h 03 min``; ``–`` when missing."""
    if seconds is None:
        return "–"
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


def fmt_time(value: datetime | None) -> str:
    """UTC time as ``2026-11-30 18:40:12 UTC``; ``–`` when missing."""
    if value is None:
        return "–"
    return value.strftime("%Y-%m-%d %H:%M:%S UTC")


def fmt_json(value: Any) -> str:
    """A configuration value as JSON text (``true``, ``64``, ``"fp8"``)."""
    return json.dumps(value, sort_keys=True, default=str)


TEMPLATES.env.filters.update(
    num=fmt_num, pct=fmt_pct, duration=fmt_duration, time=fmt_time, tojson_text=fmt_json
)


class PageCache:
    """A thread-safe LRU of results the pages compute (comparisons, regressions), keyed
    by what they depend on (e.g. run ids and statuses), so a key changes when the data
    does; at most ``size`` entries."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any | None:
        """The value stored under ``key`` (now the most recently used), or None."""
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
            return hit

    def put(self, key: Any, value: Any) -> None:
        """Store ``value``, dropping the least recently used entries beyond ``size``."""
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


def render(
    request: Request, template: str, context: dict[str, Any], status_code: int = 200
) -> HTMLResponse:
    """Render ``web/templates/<template>`` with ``request`` in the context, and
    ``principal`` (who is signed in; :class:`orchestrator.core.auth.Principal`, None on the
    sign-in page) for the header, the CSRF token and the role-dependent buttons."""
    context = {"principal": getattr(request.state, "principal", None), **context}
    return TEMPLATES.TemplateResponse(request, template, context, status_code=status_code)


def not_found(request: Request, what: str) -> HTMLResponse:
    """The HTML 404 page (the JSON API answers problem+json instead)."""
    return render(request, "error.html", {"title": "Not found", "message": what}, 404)


def build_router() -> APIRouter:
    """All dashboard pages (kept out of the OpenAPI document), each behind the sign-in
    (:data:`api.auth.PAGE_AUTH`: viewer or above, else a redirect to ``/login``)."""
    from api.auth import PAGE_AUTH
    from web.pages import compare, experiment, history, run, schedules

    router = APIRouter(include_in_schema=False, dependencies=PAGE_AUTH)
    for module in (history, experiment, run, compare, schedules):
        router.include_router(module.router)
    return router
