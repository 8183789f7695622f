"""API tokens, dashboard sign-ins and the audit trail."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session

from orchestrator.core.models import ApiToken, AuditEvent, WebSession


class TokenRepository:
    """API tokens (:class:`ApiToken`); hashing and checks live in :mod:`orchestrator.core.auth`."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, token: ApiToken) -> ApiToken:
        self.session.add(token)
        self.session.flush()
        return token

    def by_key_id(self, key_id: str) -> ApiToken | None:
        return self.session.scalar(select(ApiToken).where(ApiToken.key_id == key_id))

    def get(self, token_id: str) -> ApiToken | None:
        return self.session.get(ApiToken, token_id)

    def active_by_name(self, name: str) -> ApiToken | None:
        return self.session.scalar(
            select(ApiToken).where(ApiToken.name == name, ApiToken.revoked_at.is_(None))
        )

    def any_active(self, now: datetime) -> bool:
        """Whether a token exists that is neither revoked nor expired at ``now``."""
        return (
            self.session.scalar(
                select(ApiToken.id)
                .where(
                    ApiToken.revoked_at.is_(None),
                    or_(ApiToken.expires_at.is_(None), ApiToken.expires_at > now),
                )
                .limit(1)
            )
            is not None
        )

    def touch(self, token_id: str, now: datetime, unless_since: datetime) -> None:
        """Set ``last_used_at`` to ``now`` unless it is already at or after ``unless_since``."""
        self.session.execute(
            update(ApiToken)
            .where(
                ApiToken.id == token_id,
                or_(ApiToken.last_used_at.is_(None), ApiToken.last_used_at < unless_since),
            )
            .values(last_used_at=now)
        )

    def all(self, *, include_revoked: bool = True) -> Sequence[ApiToken]:
        """Every token, newest first."""
        q = select(ApiToken).order_by(ApiToken.created_at.desc(), ApiToken.id)
        if not include_revoked:
            q = q.where(ApiToken.revoked_at.is_(None))
        return self.session.scalars(q).all()


class WebSessionRepository:
    """Dashboard sign-ins (:class:`WebSession`), looked up by the hash of the cookie."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, web_session: WebSession) -> WebSession:
        self.session.add(web_session)
        self.session.flush()
        return web_session

    def get(self, id_hash: str) -> WebSession | None:
        return self.session.get(WebSession, id_hash)

    def delete(self, id_hash: str) -> None:
        self.session.execute(delete(WebSession).where(WebSession.id_hash == id_hash))

    def delete_for_token(self, token_id: str) -> None:
        self.session.execute(delete(WebSession).where(WebSession.token_id == token_id))

    def delete_expired(self, now: datetime) -> None:
        self.session.execute(delete(WebSession).where(WebSession.expires_at <= now))


class AuditRepository:
    """The audit trail (:class:`AuditEvent`)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(
        self,
        *,
        actor: str,
        action: str,
        target: str,
        role: str | None = None,
        token_id: str | None = None,
    ) -> None:
        self.session.add(
            AuditEvent(actor=actor, role=role, token_id=token_id, action=action, target=target)
        )

    def page(self, *, limit: int, offset: int) -> tuple[Sequence[AuditEvent], int]:
        """Events, newest first."""
        total = self.session.scalar(select(func.count()).select_from(AuditEvent)) or 0
        rows = self.session.scalars(
            select(AuditEvent)
            .order_by(AuditEvent.at.desc(), AuditEvent.id.desc())
            .limit(limit)
            .offset(offset)
        ).all()
        return rows, int(total)
