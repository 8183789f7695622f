"""The sign-in pages: ``/login`` (paste an API token; the form carries its own
double-submit CSRF cookie against login CSRF) and ``/logout`` (a form with the
session's CSRF token). Who a request is, and the session cookie's meaning, are
:mod:`api.auth`'s; the rules (tokens, sessions) are :mod:`orchestrator.core.auth`'s.
"""

from __future__ import annotations

import logging
import secrets
from urllib.parse import parse_qsl

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy.orm import Session

from api import problems
from api.auth import LOGIN_CSRF_COOKIE, SESSION_COOKIE
from api.deps import SessionDep
from orchestrator.core import auth
from orchestrator.core.auth import Principal
from web.render import render

log = logging.getLogger(__name__)

router = APIRouter(include_in_schema=False)


def safe_next(value: str | None) -> str:
    """A local path to go to after signing in (never another site): else ``/``."""
    if not value or not value.startswith("/") or value.startswith(("//", "/\\")):
        return "/"
    if any(c in value for c in "\r\n\\"):
        return "/"
    return value


def _secure(request: Request) -> bool:
    public = request.app.state.settings.api.public_url or ""
    return request.url.scheme == "https" or public.startswith("https://")


def _login_page(
    request: Request,
    session: Session,
    next_url: str,
    error: str | None = None,
    status: int = 200,
) -> HTMLResponse:
    csrf = secrets.token_urlsafe(32)
    is_open = request.app.state.settings.api.auth == "none" or auth.open_access(
        request.app.state.settings, session, request.client.host if request.client else None
    )
    response = render(
        request,
        "login.html",
        {"nav": "login", "next": next_url, "csrf": csrf, "error": error, "open": is_open},
        status,
    )
    response.set_cookie(
        LOGIN_CSRF_COOKIE,
        csrf,
        max_age=3600,
        httponly=True,
        samesite="strict",
        secure=_secure(request),
        path="/login",
    )
    return response


@router.get("/login", response_class=HTMLResponse)
def login_form(
    request: Request,
    session: SessionDep,
    next: str | None = None,  # noqa: A002
) -> HTMLResponse:
    """The sign-in form: paste an API token."""
    return _login_page(request, session, safe_next(next))


async def _form(request: Request) -> dict[str, str]:
    body = (await request.body())[:20_000].decode("utf-8", errors="replace")
    return dict(parse_qsl(body, keep_blank_values=True))


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request, session: SessionDep) -> Response:
    """Check the token, start a session (HttpOnly, SameSite=Strict cookie), go to ``next``."""
    form = await _form(request)
    next_url = safe_next(form.get("next"))
    if not auth.csrf_matches(request.cookies.get(LOGIN_CSRF_COOKIE), form.get("csrf")):
        return await run_in_threadpool(
            _login_page,
            request,
            session,
            next_url,
            "The sign-in form expired or came from another site; try again.",
            403,
        )
    return await run_in_threadpool(_sign_in, request, session, form.get("token", ""), next_url)


def _sign_in(request: Request, session: Session, raw: str, next_url: str) -> Response:
    settings = request.app.state.settings
    cookie: str | None = None
    token = auth.verify_token(session, raw)
    if token is not None:
        auth.touch_token(request.app.state.session_factory, token)
        cookie, _ = auth.start_web_session(session, token, settings.api.session_ttl_s)
        name = token.name
        auth.record(
            session, Principal(token.name, token.role, "token", token.id), "login", "/login"
        )
    if cookie is None:
        log.warning("dashboard sign-in with an invalid token from %s", request.client)
        return _login_page(
            request, session, next_url, "That token is unknown, revoked or expired.", 401
        )
    log.info("dashboard sign-in: %s", name)
    response = RedirectResponse(next_url, status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        cookie,
        max_age=int(settings.api.session_ttl_s),
        httponly=True,
        samesite="strict",
        secure=_secure(request),
        path="/",
    )
    response.delete_cookie(LOGIN_CSRF_COOKIE, path="/login")
    return response


@router.post("/logout")
async def logout(request: Request, session: SessionDep) -> Response:
    """End the dashboard session (form with the session's CSRF token)."""
    form = await _form(request)
    cookie = request.cookies.get(SESSION_COOKIE)
    if cookie:

        def end() -> bool:
            ws = auth.find_web_session(session, cookie)
            if ws is not None and not auth.csrf_matches(ws.csrf_token, form.get("csrf")):
                return False
            auth.end_web_session(session, cookie)
            return True

        if not await run_in_threadpool(end):
            return problems.problem(
                request,
                403,
                "csrf_failed",
                "Forbidden",
                "sign-out must come from the dashboard's own form (CSRF token missing or wrong)",
            )
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response
