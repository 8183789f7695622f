"""RFC 9457 ``application/problem+json`` responses for every error the API returns.

Members: ``type`` (a stable URI per code), ``title``, ``status``, ``detail``,
``instance`` (the request path), ``code`` (stable, machine-readable) and, for
validation problems, ``errors``: ``[{"loc": [...], "msg": str, "type": str}]``.

A problem that a retry can cure (503 ``submissions_busy``, ``database_unavailable``,
``database_busy``) carries a ``Retry-After`` header (seconds) and ``retry_after_s``.
A database that cannot be reached is a 503 ``database_unavailable`` everywhere (an
HTML page on the dashboard's pages), logged once per outage
(:data:`orchestrator.core.db.database_health`), never a traceback per request. Bodies
never carry exception class names, SQL or server paths.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DataError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.core.db import database_health, is_unavailable
from orchestrator.core.errors import (
    DatabaseBusyError,
    DatabaseUnavailableError,
    RequestInvalidError,
    UnauthenticatedError,
    VlabError,
)
from orchestrator.core.telemetry import count_refusal

log = logging.getLogger(__name__)
PROBLEM_JSON = "application/problem+json"
#: Longest ``detail`` answered (the full text stays in ``errors`` or the log).
MAX_DETAIL = 2000
#: Retry-After (seconds) of a 503 about the database
DATABASE_RETRY_AFTER_S = 5


def problem(
    request: Request, status: int, code: str, title: str, detail: str, **extra: Any
) -> JSONResponse:
    if len(detail) > MAX_DETAIL:  # e.g. a 5,000-character id echoed back in a 404
        detail = detail[:MAX_DETAIL] + "…"
    body: dict[str, Any] = {
        "type": f"https://vlab.dev/problems/{code.replace('_', '-')}",
        "title": title,
        "status": status,
        "detail": detail,
        "instance": request.url.path,
        "code": code,
    }
    body.update(extra)
    count_refusal(status, code)  # vlab_requests_refused_total
    headers = {}
    if isinstance(extra.get("retry_after_s"), int | float):
        headers["Retry-After"] = str(max(1, round(extra["retry_after_s"])))
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


#: ``(request, title, message, status) -> HTML response``: an error as a dashboard page.
ErrorPage = Callable[[Request, str, str, int], Response]
#: ``(request, exception) -> response``: an exception handler.
ExceptionHandler = Callable[[Request, Exception], Awaitable[Response]]


def _is_page(request: Request) -> bool:
    """A dashboard page (answered in HTML), not the JSON API or the health check."""
    path = request.url.path
    if path.startswith(("/api/", "/static/")) or path in ("/healthz", "/openapi.json"):
        return False
    accept = request.headers.get("accept", "")
    return "html" in accept or "json" not in accept


def answer(request: Request, exc: VlabError) -> JSONResponse:
    """The problem+json answer of a :class:`VlabError`: status, code and title from its
    class (the base of its kind gives the status), plus the kind's headers."""
    response = problem(request, exc.status, exc.code, exc.title, exc.detail, **exc.extra)
    for kind, headers in KIND_HEADERS.items():
        if isinstance(exc, kind):
            response.headers.update(headers)
    return response


#: Headers every answer of a kind carries (besides ``Retry-After`` from ``retry_after_s``).
KIND_HEADERS: dict[type[VlabError], dict[str, str]] = {
    UnauthenticatedError: {"WWW-Authenticate": 'Bearer realm="vlab"'},
}


def database_unavailable(request: Request, exc: BaseException | None = None) -> Response:
    """503 ``database_unavailable`` (an HTML page for dashboard pages); the outage is
    logged once by :data:`database_health`."""
    if exc is not None:
        database_health.failed(exc, "api")
    error = DatabaseUnavailableError(
        "the database cannot be reached; the service answers again as soon as it is back "
        f"(retry in {DATABASE_RETRY_AFTER_S} s)",
        retry_after_s=DATABASE_RETRY_AFTER_S,
    )
    error_page: ErrorPage | None = getattr(request.app.state, "error_page", None)
    if error_page is not None and _is_page(request):
        page = error_page(request, error.title, f"The service is up but {error.detail}.", 503)
        page.headers["Retry-After"] = str(DATABASE_RETRY_AFTER_S)
        count_refusal(503, error.code)
        return page
    return answer(request, error)


def _clean_errors(errors: list[Any]) -> list[dict[str, Any]]:
    out = []
    for err in errors:
        out.append(
            {
                "loc": list(err.get("loc", [])),
                "msg": str(err.get("msg", "")),
                "type": str(err.get("type", "")),
            }
        )
    return out


def _allowed_methods(request: Request) -> list[str]:
    """Every method the API has for the request's path (the ``Allow`` of a 405), from the
    OpenAPI description, where each path lists all its operations; empty when the path
    is not an API path."""
    path = request.url.path
    for template, item in (request.app.openapi().get("paths") or {}).items():
        parts = re.split(r"\{[^/}]+\}", template)
        if re.fullmatch("[^/]+".join(re.escape(p) for p in parts), path):
            methods = {m.upper() for m in item if m in _METHODS}
            if "GET" in methods:
                methods.add("HEAD")
            return sorted(methods)
    return []


_METHODS = ("get", "put", "post", "delete", "patch", "options", "head", "trace")


async def _vlab(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, VlabError)
    return answer(request, exc)


async def _db_down(request: Request, exc: Exception) -> Response:
    if not is_unavailable(exc):
        return await _unhandled(request, exc)
    return database_unavailable(request, exc)


async def _db_busy(request: Request, exc: Exception) -> Response:
    log.warning("no free database connection for %s: %s", request.url.path, exc)
    return answer(
        request,
        DatabaseBusyError(
            "every database connection is in use; retry shortly",
            retry_after_s=DATABASE_RETRY_AFTER_S,
        ),
    )


async def _validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = _clean_errors(list(exc.errors()))
    detail = f"{len(errors)} problem(s): " + "; ".join(
        f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors[:5]
    )
    return answer(request, RequestInvalidError(detail, errors=errors))


async def _http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    response = problem(request, exc.status_code, code, str(exc.detail), str(exc.detail))
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    if exc.status_code == 405:  # RFC 9110: every method the resource has, not one route's
        allowed = _allowed_methods(request)
        if allowed:
            response.headers["Allow"] = ", ".join(allowed)
    return response


async def _no_nul(request: Request, call_next: Any) -> Any:
    # Postgres text cannot hold U+0000: refuse it at the edge instead of failing in SQL
    if "\x00" in request.url.path or "\x00" in str(request.query_params):
        return answer(
            request,
            RequestInvalidError(
                "the URL contains a NUL character (%00), which no field accepts",
                code_hint="nul_character",
            ),
        )
    return await call_next(request)


async def _data(request: Request, exc: Exception) -> Response:
    text = str(getattr(exc, "orig", exc))
    if "\\u0000" in text or "NUL" in text or "0x00" in text:
        return answer(
            request,
            RequestInvalidError(
                "a text value contains a NUL character (\\u0000), which cannot be stored",
                code_hint="nul_character",
            ),
        )
    return await _unhandled(request, exc)


async def _unhandled(request: Request, exc: Exception) -> Response:
    if is_unavailable(exc):
        return database_unavailable(request, exc)
    # the error's text can hold SQL and parameters: it goes to the log, not the client
    error_id = uuid.uuid4().hex[:12]
    log.exception("unhandled error %s on %s", error_id, request.url.path)
    return answer(
        request,
        VlabError(f"an internal error; the service log has it as {error_id}", error_id=error_id),
    )


#: Which handler answers which exception (the most specific class wins): every
#: :class:`VlabError` by its kind, the driver's and the framework's errors translated.
HANDLERS: tuple[tuple[type[Exception], ExceptionHandler], ...] = (
    (VlabError, _vlab),
    (OperationalError, _db_down),
    (InterfaceError, _db_down),
    (PoolTimeoutError, _db_busy),
    (RequestValidationError, _validation),
    (StarletteHTTPException, _http),
    (DataError, _data),
    (Exception, _unhandled),
)


def install(app: FastAPI, error_page: ErrorPage | None = None) -> None:
    """Answer every error as problem+json (:data:`HANDLERS`); ``error_page`` renders the
    HTML page a dashboard page gets instead when the database is down (the dashboard's,
    given by the application factory)."""
    app.state.error_page = error_page
    app.middleware("http")(_no_nul)
    for exc_type, handler in HANDLERS:
        app.add_exception_handler(exc_type, handler)
