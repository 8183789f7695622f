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
- :data:`tokens_router`: ``/api/v1/tokens`` (admin), ``/api/v1/audit`` (admin) and
  ``/api/v1/auth/me`` (anyone signed in).

Errors: 401 problem+json ``unauthenticated`` with ``WWW-Authenticate: Bearer``;
403 ``forbidden`` with ``required_role``; 403 ``csrf_failed``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from api import problems
from api.deps import SessionDep
from orchestrator.core import auth
from orchestrator.core.auth import ROLE_SCOPE, Principal, Role
from orchestrator.core.errors import ForbiddenError, UnauthenticatedError
from orchestrator.core.models import ApiToken
from orchestrator.core.repositories import AuditRepository, TokenRepository, utcnow

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


# ------------------------------------------------------------------ tokens and audit API


class TokenIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=auth.TOKEN_NAME_PATTERN, description="who or what holds it")
    role: Role
    expires_in_days: float | None = Field(
        None,
        ge=1 / 24,
        le=3650,
        description="from one hour (1/24) to 3650 days; omitted: the token does not expire",
    )


class TokenOut(BaseModel):
    id: str
    name: str
    role: str
    key_id: str = Field(description="the public part of the token: vlab_<key_id>_...")
    created_at: datetime
    created_by: str | None
    expires_at: datetime | None
    last_used_at: datetime | None
    revoked_at: datetime | None
    revoked_by: str | None
    active: bool


class TokenCreated(TokenOut):
    token: str = Field(description="the secret token; shown only in this response")


class Me(BaseModel):
    name: str
    role: str
    via: str = Field(description="token, session, open (loopback, no token) or disabled")


class AuditOut(BaseModel):
    at: datetime
    actor: str
    role: str | None
    action: str
    target: str


class AuditPage(BaseModel):
    items: list[AuditOut]
    total: int
    limit: int
    offset: int


def token_out(token: ApiToken) -> TokenOut:
    return TokenOut(
        id=token.id,
        name=token.name,
        role=token.role,
        key_id=token.key_id,
        created_at=token.created_at,
        created_by=token.created_by,
        expires_at=token.expires_at,
        last_used_at=token.last_used_at,
        revoked_at=token.revoked_at,
        revoked_by=token.revoked_by,
        active=auth.token_usable(token, utcnow()),
    )


tokens_router = APIRouter(prefix="/api/v1", tags=["auth"])


@tokens_router.get("/auth/me", response_model=Me)
def me(principal: PrincipalDep) -> Me:
    """Who this request acts as."""
    return Me(name=principal.name, role=principal.role, via=principal.via)


@tokens_router.get("/tokens", response_model=list[TokenOut], dependencies=[RequireAdmin])
def list_tokens(session: SessionDep) -> list[TokenOut]:
    """Every token, newest first (never their secrets)."""
    return [token_out(t) for t in TokenRepository(session).all()]


@tokens_router.post(
    "/tokens", status_code=201, response_model=TokenCreated, dependencies=[RequireAdmin]
)
def create_token(body: TokenIn, principal: PrincipalDep, session: SessionDep) -> TokenCreated:
    """Create a token; the response carries its secret, which is not shown again.

    422 ``token_invalid`` / ``token_name_taken`` for a bad name or one an active token has.
    """
    expires = utcnow() + timedelta(days=body.expires_in_days) if body.expires_in_days else None
    token, secret = auth.create_token(
        session, name=body.name, role=body.role, created_by=principal.name, expires_at=expires
    )
    session.refresh(token)
    return TokenCreated(**token_out(token).model_dump(), token=secret)


@tokens_router.delete("/tokens/{ident}", response_model=TokenOut, dependencies=[RequireAdmin])
def revoke_token(ident: str, principal: PrincipalDep, session: SessionDep) -> TokenOut:
    """Revoke a token (by id, key id or name) and end its dashboard sessions."""
    return token_out(auth.revoke_token(session, ident, by=principal.name))


@tokens_router.get("/audit", response_model=AuditPage, dependencies=[RequireAdmin])
def audit_events(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**12)] = 0,
) -> AuditPage:
    """Who changed what, newest first: each successful state-changing request, sign-in,
    and token created or revoked from the command line."""
    rows, total = AuditRepository(session).page(limit=limit, offset=offset)
    return AuditPage(
        items=[
            AuditOut(at=e.at, actor=e.actor, role=e.role, action=e.action, target=e.target)
            for e in rows
        ],
        total=total,
        limit=limit,
        offset=offset,
    )


# ------------------------------------------------------------------ wiring


def install(app: FastAPI) -> None:
    """Refuse an unsafe configuration (:func:`orchestrator.core.auth.startup_check`), register
    the 401/redirect handlers, the token API and ``/openapi.json`` (which needs a viewer
    like any other read)."""
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

    app.include_router(tokens_router, dependencies=API_AUTH)

    @app.get("/openapi.json", include_in_schema=False, dependencies=API_AUTH)
    def openapi_json() -> JSONResponse:
        return JSONResponse(app.openapi())
