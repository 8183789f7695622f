"""Authentication and roles for the API and the dashboard.

The rules live in :mod:`orchestrator.core.auth`.

- :data:`API_AUTH`: the dependency every ``/api/v1`` router is included with. It
  resolves who the request is (``Authorization: Bearer <token>``, else the dashboard
  session cookie, else open access on loopback with no token), requires ``viewer``
  for GET/HEAD/OPTIONS and ``operator`` for every other method (or the role a route
  declares with :func:`require_role`), requires the session's CSRF token in
  ``X-CSRF-Token`` on state-changing requests made with the cookie, and writes an
  audit event for each successful state-changing request.
- :data:`PAGE_AUTH`: the same for dashboard pages, which redirect to ``/login``
  instead of answering 401. Pages only read (the one page POST, ``/compare``, is a
  long query), so they need ``viewer`` and no CSRF token.
- the sign-in pages ``/login`` and ``/logout`` are the dashboard's
  (:mod:`web.pages.login`); they use :data:`SESSION_COOKIE` and :data:`LOGIN_CSRF_COOKIE`.
- :func:`install`: the startup check of the configuration and the 401 / sign-in
  redirect handlers. The routes of tokens, audit and ``/auth/me`` are a router like the
  others (:mod:`api.routes.auth`); ``/openapi.json`` is :mod:`api.routes.docs`'.

Errors: 401 problem+json ``unauthenticated`` with ``WWW-Authenticate: Bearer``;
403 ``forbidden`` with ``required_role``; 403 ``csrf_failed``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api import problems
from api.deps import SessionDep
from orchestrator.core import auth
from orchestrator.core.auth import ROLE_SCOPE, Principal, Role
from orchestrator.core.errors import ForbiddenError, UnauthenticatedError

log = logging.getLogger(__name__)

SESSION_COOKIE = "vlab_session"
LOGIN_CSRF_COOKIE = "vlab_login_csrf"
CSRF_HEADER = "X-CSRF-Token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

bearer = HTTPBearer(
    auto_error=False,
    scheme_name="token",
    description="An API token (`vlab token create --name NAME --role viewer|operator|admin`).",
)
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


class LoginRequiredError(Exception):
    """A dashboard page was opened without a valid sign-in: redirect to ``/login``."""

    def __init__(self, next_url: str) -> None:
        super().__init__(next_url)
        self.next_url = next_url


def _resolve(
    request: Request, creds: HTTPAuthorizationCredentials | None, session: Session
) -> Principal | None:
    """Who the request is, or None (no valid credentials and no open access)."""
    cached: Principal | None = getattr(request.state, "principal", None)
    if cached is not None:
        return cached
    settings = request.app.state.settings
    principal: Principal | None = None
    if settings.api.auth == "none":
        principal = auth.anonymous("disabled")
    elif creds is not None:
        token = auth.verify_token(session, creds.credentials)
        if token is not None:
            auth.touch_token(request.app.state.session_factory, token)
            principal = Principal(token.name, token.role, "token", token.id)
    elif cookie := request.cookies.get(SESSION_COOKIE):
        ws = auth.find_web_session(session, cookie)
        if ws is not None:
            principal = Principal(
                ws.token.name, ws.token.role, "session", ws.token.id, ws.csrf_token
            )
    if principal is None and auth.open_access(
        settings, session, request.client.host if request.client else None
    ):
        principal = auth.anonymous("open")
    if principal is not None:
        request.state.principal = principal
        auth.set_actor(session, principal.name)
    return principal


def current_principal(request: Request, creds: BearerDep, session: SessionDep) -> Principal:
    """The caller; 401 ``unauthenticated`` when there is none."""
    principal = _resolve(request, creds, session)
    if principal is None:
        if creds is not None:
            detail = "the token is unknown, revoked or expired"
        elif request.cookies.get(SESSION_COOKIE):
            detail = "the dashboard session has ended; sign in again at /login"
        else:
            detail = "this request needs an API token: send Authorization: Bearer <token>"
        raise UnauthenticatedError(detail)
    return principal


PrincipalDep = Annotated[Principal, Depends(current_principal)]


def _route_role(request: Request) -> Role | None:
    """The role the matched route declares with :func:`require_role`, if any."""
    route = request.scope.get("route")
    roles = [
        getattr(d.dependency, "required_role", None) for d in getattr(route, "dependencies", [])
    ]
    declared = [r for r in roles if r is not None]
    return max(declared, key=auth.ROLES.index) if declared else None


def needed_role(request: Request) -> Role:
    """``viewer`` for GET/HEAD/OPTIONS, else ``operator``; a route's declared role if higher."""
    by_method: Role = "viewer" if request.method in SAFE_METHODS else "operator"
    declared = _route_role(request)
    if declared is not None and auth.has_role(declared, by_method):
        return declared
    return by_method


def forbidden(principal: Principal, needed: Role) -> ForbiddenError:
    return ForbiddenError(
        f"this request needs the {needed} role ({ROLE_SCOPE[needed]}); "
        f"token {principal.name!r} has the {principal.role} role",
        required_role=needed,
        role=principal.role,
    )


def authorize(
    request: Request, principal: PrincipalDep, session: SessionDep
) -> Iterator[Principal]:
    """Router dependency of the JSON API: role, CSRF (cookie sign-ins), audit event."""
    needed = needed_role(request)
    if not principal.allows(needed):
        raise forbidden(principal, needed)
    unsafe = request.method not in SAFE_METHODS
    if (
        unsafe
        and principal.via == "session"
        and not auth.csrf_matches(principal.csrf_token, request.headers.get(CSRF_HEADER))
    ):
        raise ForbiddenError(
            f"a dashboard request that changes something must carry the page's CSRF token "
            f"in {CSRF_HEADER}; it was missing or wrong (a request from another site?)",
            code_hint="csrf_failed",
        )
    yield principal
    if unsafe:  # reached only when the path function succeeded
        auth.record(session, principal, request.method, request.url.path)


def require_role(role: Role) -> Any:
    """A route dependency requiring ``role`` (also read by :func:`authorize`, so the 403
    names the route's role): ``@router.post(..., dependencies=[require_role("admin")])``."""

    def check(principal: PrincipalDep) -> Principal:
        if not principal.allows(role):
            raise forbidden(principal, role)
        return principal

    check.required_role = role  # type: ignore[attr-defined]
    return Depends(check)


#: the dependencies every ``/api/v1`` router is included with
API_AUTH = [Depends(authorize, scope="function")]
RequireAdmin = require_role("admin")


def page_principal(request: Request, creds: BearerDep, session: SessionDep) -> Principal:
    """Dashboard pages: the caller (viewer or above), else a redirect to ``/login``."""
    principal = _resolve(request, creds, session)
    if principal is None:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequiredError(target)
    return principal


PAGE_AUTH = [Depends(page_principal)]


# ------------------------------------------------------------------ wiring


def install(app: FastAPI) -> None:
    """Refuse an unsafe configuration (:func:`orchestrator.core.auth.startup_check`) and
    register the 401 / sign-in redirect handlers."""
    settings = app.state.settings
    warning = auth.startup_check(settings, app.state.session_factory)
    if warning:
        log.warning(warning)

    @app.exception_handler(UnauthenticatedError)
    async def _unauthenticated(request: Request, exc: UnauthenticatedError) -> JSONResponse:
        response = problems.problem(request, exc.status, exc.code, exc.title, exc.detail)
        response.headers["WWW-Authenticate"] = 'Bearer realm="vlab"'
        return response

    @app.exception_handler(LoginRequiredError)
    async def _login_required(request: Request, exc: LoginRequiredError) -> Response:
        return RedirectResponse(f"/login?next={quote(exc.next_url, safe='/')}", status_code=303)
