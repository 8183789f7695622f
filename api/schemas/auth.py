"""Bodies of the tokens, sign-in and audit API (``/api/v1/tokens``, ``/api/v1/auth/me``,
``/api/v1/audit``; routes: :mod:`api.routes.auth`)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.core import auth
from orchestrator.core.auth import Role


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
