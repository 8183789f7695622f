"""``/api/v1/tokens`` (admin), ``/api/v1/audit`` (admin) and ``/api/v1/auth/me`` (anyone
signed in): API tokens, the audit trail, who a request acts as. Who a request is and
what it may do are :mod:`api.auth`'s; the rules are :mod:`orchestrator.core.auth`'s."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter

from api.auth import PrincipalDep, RequireAdmin
from api.deps import SessionDep
from api.routes.common import Limit, Offset
from api.schemas import AuditOut, AuditPage, Me, TokenCreated, TokenIn, TokenOut
from orchestrator.core import auth
from orchestrator.core.models import ApiToken
from orchestrator.core.repositories import AuditRepository, TokenRepository, utcnow

router = APIRouter(prefix="/api/v1", tags=["auth"])


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


@router.get("/auth/me", response_model=Me)
def me(principal: PrincipalDep) -> Me:
    """Who this request acts as."""
    return Me(name=principal.name, role=principal.role, via=principal.via)


@router.get("/tokens", response_model=list[TokenOut], dependencies=[RequireAdmin])
def list_tokens(session: SessionDep) -> list[TokenOut]:
    """Every token, newest first (never their secrets)."""
    return [token_out(t) for t in TokenRepository(session).all()]


@router.post("/tokens", status_code=201, response_model=TokenCreated, dependencies=[RequireAdmin])
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


@router.delete("/tokens/{ident}", response_model=TokenOut, dependencies=[RequireAdmin])
def revoke_token(ident: str, principal: PrincipalDep, session: SessionDep) -> TokenOut:
    """Revoke a token (by id, key id or name) and end its dashboard sessions."""
    return token_out(auth.revoke_token(session, ident, by=principal.name))


@router.get("/audit", response_model=AuditPage, dependencies=[RequireAdmin])
def audit_events(
    session: SessionDep,
    limit: Limit = 50,
    offset: Offset = 0,
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
