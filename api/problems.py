"""RFC 9457 ``application/problem+json`` responses for every error the API returns.

Members: ``type`` (a stable URI per code), ``title``, ``status``, ``detail``,
``instance`` (the request path), ``code`` (stable, machine-readable) and, for
validation problems, ``errors``: ``[{"loc": [...], "msg": str, "type": str}]``.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.errors import VlabError

log = logging.getLogger(__name__)
PROBLEM_JSON = "application/problem+json"


def problem(
    request: Request, status: int, code: str, title: str, detail: str, **extra: Any
) -> JSONResponse:
    body: dict[str, Any] = {
        "type": f"https://vlab.dev/problems/{code.replace('_', '-')}",
        "title": title,
        "status": status,
        "detail": detail,
        "instance": request.url.path,
        "code": code,
    }
    body.update(extra)
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON)


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


def install(app: FastAPI) -> None:
    @app.exception_handler(VlabError)
    async def _vlab(request: Request, exc: VlabError) -> JSONResponse:
        return problem(request, exc.status, exc.code, exc.title, exc.detail, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = _clean_errors(list(exc.errors()))
        return problem(
            request,
            422,
            "request_invalid",
            "Invalid request",
            f"{len(errors)} problem(s): "
            + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors[:5]),
            errors=errors,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return problem(request, exc.status_code, code, str(exc.detail), str(exc.detail))

    @app.middleware("http")
    async def _no_nul(request: Request, call_next: Any) -> Any:
        # Postgres text cannot hold U+0000: refuse it at the edge instead of failing in SQL
        if "\x00" in request.url.path or "\x00" in str(request.query_params):
            return problem(
                request,
                422,
                "nul_character",
                "Invalid request",
                "the URL contains a NUL character (%00), which no field accepts",
            )
        return await call_next(request)

    @app.exception_handler(DataError)
    async def _data(request: Request, exc: DataError) -> JSONResponse:
        text = str(exc.orig)
        if "\\u0000" in text or "NUL" in text or "0x00" in text:
            return problem(
                request,
                422,
                "nul_character",
                "Invalid request",
                "a text value contains a NUL character (\\u0000), which cannot be stored",
            )
        return await _unhandled(request, exc)

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        # the error's text can hold SQL and parameters: it goes to the log, not the client
        error_id = uuid.uuid4().hex[:12]
        log.exception("unhandled error %s on %s", error_id, request.url.path)
        return problem(
            request,
            500,
            "internal_error",
            "Internal error",
            f"an internal error ({type(exc).__name__}); the service log has it as {error_id}",
            error_id=error_id,
        )
