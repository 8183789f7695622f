"""Rendering for the dashboard pages: the Jinja2 templates of ``web/templates`` with
their filters (numbers, percentages, durations, times), the page cache, the 404 page.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from jinja2 import Undefined

WEB = Path(__file__).resolve().parent
TEMPLATES = Jinja2Templates(directory=WEB / "templates")
#: The dashboard's static assets, served at ``/static``.
STATIC = WEB / "static"


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


def error_page(request: Request, title: str, message: str, status_code: int) -> HTMLResponse:
    """An error as an HTML page (:data:`api.problems.ErrorPage`: the dashboard's answer
    where the JSON API answers problem+json)."""
    return render(request, "error.html", {"title": title, "message": message}, status_code)
