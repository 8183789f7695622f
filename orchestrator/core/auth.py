"""Authentication and roles: API tokens, dashboard sessions, the loopback rule, audit stamps.

**Tokens.** ``vlab token create --name NAME --role viewer|operator|admin`` prints
``vlab_<key_id>_<secret>`` once; clients send it as ``Authorization: Bearer <token>``.
``key_id`` (16 hex digits, public) finds the row; the 256-bit ``secret``
(:func:`secrets.token_urlsafe`) is stored only as ``SHA-256(salt || secret)`` with a
random per-token salt, and checked with :func:`hmac.compare_digest` (constant time).
A fast hash is the right tool here: slow password hashes (bcrypt, scrypt, Argon2)
exist to make guessing *low-entropy* passwords expensive, while a 256-bit random
secret cannot be guessed at any hash speed; the salt keeps equal secrets (never
expected) from having equal hashes, and checking costs microseconds per request.
Revoked and expired tokens authenticate nothing.

**Roles** are ordered: ``viewer`` (every GET) < ``operator`` (submit, cancel, add
variants, schedules, on-demand analyses: every other method) < ``admin`` (tokens,
cluster parity checks, path policy).

**The loopback rule.** With ``api.auth = "tokens"`` (the default) and no active
token, a server bound to a loopback address (``127.0.0.1``, ``::1``, ``localhost``)
is open: every request acts as the ``anonymous`` admin. Once any active token exists,
every request needs one (or a dashboard session). Binding elsewhere without an active
token refuses to start (:func:`startup_check`) unless ``api.auth = "none"``, which
turns authentication off entirely (every request is the anonymous admin) and is
warned about loudly.

**Dashboard sessions.** Signing in with a token creates a :class:`WebSession`: the
HttpOnly, SameSite=Strict cookie holds a random 256-bit id (stored as its SHA-256)
and the session has its own CSRF token (the synchronizer-token pattern): pages
render it and send it back in ``X-CSRF-Token`` on every state-changing request; a
cookie-authenticated request without it is refused. Sessions expire
(``api.session_ttl_s``), end at sign-out and end with their token.

**Who did what.** The API marks its request's database session with the caller
(:func:`set_actor`); a ``before_flush`` hook then stamps ``submitted_by`` on new
experiments and runs, ``cancelled_by`` on runs whose cancellation this session asked
for, and ``created_by`` / ``updated_by`` on schedules whose settings it changed. The
API also writes one :class:`~orchestrator.core.models.AuditEvent` per successful
state-changing request.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import event, inspect
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.errors import TokenInvalidError, TokenNameTakenError, TokenNotFoundError
from orchestrator.core.models import ApiToken, Campaign, Experiment, Run, Schedule, WebSession
from orchestrator.core.repositories import (
    AuditRepository,
    TokenRepository,
    WebSessionRepository,
    utcnow,
)
from orchestrator.core.settings import Settings

Role = Literal["viewer", "operator", "admin"]
ROLES: tuple[Role, ...] = ("viewer", "operator", "admin")
_RANK: dict[str, int] = {r: i for i, r in enumerate(ROLES)}
#: what each role may do, for messages and the README
ROLE_SCOPE = {
    "viewer": "read everything (GET)",
    "operator": "submit, cancel, add variants, change schedules, run analyses",
    "admin": "manage tokens, run cluster parity checks, change the path policy",
}
TOKEN_PREFIX = "vlab_"
#: the name requests act under with open access (loopback, no token) or ``auth: none``
ANONYMOUS = "anonymous"
TOKEN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,99}$"
_KEY_ID = re.compile(r"^[0-9a-f]{16}$")
#: ``last_used_at`` is written at most this often per token (seconds)
LAST_USED_GRANULARITY_S = 60.0
ACTOR_KEY = "vlab.actor"


class AuthSetupError(Exception):
    """The API must not start as configured (one line, said at start-up)."""


@dataclass(frozen=True)
class Principal:
    """Who a request acts as: a token's name and role, or the anonymous admin.

    ``via``: ``token`` (``Authorization: Bearer``), ``session`` (dashboard cookie;
    ``csrf_token`` is its CSRF token), ``open`` (loopback with no token) or
    ``disabled`` (``api.auth = "none"``).
    """

    name: str
    role: str
    via: Literal["token", "session", "open", "disabled"]
    token_id: str | None = None
    csrf_token: str | None = None

    def allows(self, needed: Role) -> bool:
        return has_role(self.role, needed)


def has_role(role: str, needed: Role) -> bool:
    """Whether ``role`` is ``needed`` or above it (viewer < operator < admin)."""
    return _RANK.get(role, -1) >= _RANK[needed]


def _hash(salt: str, secret: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + secret.encode()).hexdigest()


def _sha256(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def parse_token(raw: str) -> tuple[str, str] | None:
    """``(key_id, secret)`` of a ``vlab_<key_id>_<secret>`` string; None if malformed."""
    if not raw.startswith(TOKEN_PREFIX):
        return None
    key_id, sep, secret = raw[len(TOKEN_PREFIX) :].partition("_")
    if not sep or not _KEY_ID.match(key_id) or not 20 <= len(secret) <= 200:
        return None
    return key_id, secret


def create_token(
    session: Session,
    *,
    name: str,
    role: str,
    created_by: str,
    expires_at: datetime | None = None,
) -> tuple[ApiToken, str]:
    """Store a new token; returns the row and the token string (shown once, never stored).

    Raises :class:`TokenInvalidError` for a bad name or role, or a name an active
    token already has.
    """
    if role not in ROLES:
        raise TokenInvalidError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    if not re.match(TOKEN_NAME_PATTERN, name):
        raise TokenInvalidError(
            f"token name {name!r}: 1-100 letters, digits and . _ @ + - (starting with a "
            "letter or digit)"
        )
    repo = TokenRepository(session)
    if repo.active_by_name(name) is not None:
        raise TokenNameTakenError(
            f"an active token is named {name!r}: revoke it first or pick another name"
        )
    key_id, secret, salt = secrets.token_hex(8), secrets.token_urlsafe(32), secrets.token_hex(16)
    token = repo.add(
        ApiToken(
            key_id=key_id,
            name=name,
            role=role,
            salt=salt,
            secret_hash=_hash(salt, secret),
            created_by=created_by,
            expires_at=expires_at,
        )
    )
    return token, f"{TOKEN_PREFIX}{key_id}_{secret}"


def find_token(session: Session, ident: str) -> ApiToken | None:
    """A token by id, key id, or name (the active one with that name)."""
    repo = TokenRepository(session)
    return repo.get(ident) or repo.by_key_id(ident) or repo.active_by_name(ident)


def revoke_token(session: Session, ident: str, *, by: str) -> ApiToken:
    """Revoke the token ``ident`` (:func:`find_token`) and end its dashboard sessions.

    Raises :class:`TokenInvalidError` (``token_not_found``) when there is none;
    revoking a revoked token changes nothing.
    """
    token = find_token(session, ident)
    if token is None:
        raise TokenNotFoundError(f"no token {ident!r}")
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        token.revoked_by = by
        WebSessionRepository(session).delete_for_token(token.id)
        session.flush()
    return token


def token_usable(token: ApiToken, now: datetime) -> bool:
    return token.revoked_at is None and (token.expires_at is None or token.expires_at > now)


def verify_token(session: Session, raw: str, now: datetime | None = None) -> ApiToken | None:
    """The active token ``raw`` is, or None (malformed, unknown, wrong secret, revoked,
    expired). Only reads; :func:`touch_token` records the use."""
    parsed = parse_token(raw.strip())
    if parsed is None:
        return None
    key_id, secret = parsed
    token = TokenRepository(session).by_key_id(key_id)
    if token is None:
        return None
    if not hmac.compare_digest(_hash(token.salt, secret), token.secret_hash):
        return None
    if not token_usable(token, now or utcnow()):
        return None
    return token


def touch_token(session_factory: sessionmaker[Session], token: ApiToken) -> None:
    """Record that ``token`` was used now, at most once a minute, in a transaction of its
    own (so a long request never holds a lock on the token's row)."""
    now = utcnow()
    last = token.last_used_at
    if last is not None and (now - last).total_seconds() < LAST_USED_GRANULARITY_S:
        return
    with session_factory.begin() as session:
        TokenRepository(session).touch(
            token.id, now, now - timedelta(seconds=LAST_USED_GRANULARITY_S)
        )


def start_web_session(session: Session, token: ApiToken, ttl_s: float) -> tuple[str, WebSession]:
    """A new dashboard session for ``token``: returns the cookie value (a random
    256-bit id, stored only as its SHA-256) and the row (with its CSRF token)."""
    now = utcnow()
    repo = WebSessionRepository(session)
    repo.delete_expired(now)
    cookie = secrets.token_urlsafe(32)
    row = repo.add(
        WebSession(
            id_hash=_sha256(cookie),
            token_id=token.id,
            csrf_token=secrets.token_urlsafe(32),
            expires_at=now + timedelta(seconds=ttl_s),
        )
    )
    return cookie, row


def find_web_session(session: Session, cookie: str) -> WebSession | None:
    """The live session of the cookie value: not expired, its token still usable."""
    if not cookie or len(cookie) > 200:
        return None
    row = WebSessionRepository(session).get(_sha256(cookie))
    now = utcnow()
    if row is None or row.expires_at <= now or not token_usable(row.token, now):
        return None
    return row


def end_web_session(session: Session, cookie: str) -> None:
    WebSessionRepository(session).delete(_sha256(cookie))


def csrf_matches(expected: str | None, given: str | None) -> bool:
    """Constant-time comparison of CSRF tokens; False when either is missing."""
    return bool(expected and given) and hmac.compare_digest(
        str(expected).encode(), str(given).encode()
    )


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` is a loopback address (``127.0.0.0/8``, ``::1``, ``localhost``).

    ``0.0.0.0``, ``::``, an empty host and every other name are not.
    """
    if not host:
        return False
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_may_be_local(client_host: str | None) -> bool:
    """False only for a client address that is an IP and not a loopback one (a server
    bound to loopback is reached from this machine; anything else is a misconfiguration
    the open rule must not trust). Non-addresses (test clients, Unix sockets) pass."""
    if not client_host:
        return True
    try:
        return ipaddress.ip_address(client_host.strip("[]")).is_loopback
    except ValueError:
        return True


def open_access(settings: Settings, session: Session, client_host: str | None) -> bool:
    """Whether a request without valid credentials acts as the anonymous admin: the
    API is bound to a loopback address, the client is local and no active token exists."""
    return (
        is_loopback(settings.api.host)
        and client_may_be_local(client_host)
        and not TokenRepository(session).any_active(utcnow())
    )


def anonymous(via: Literal["open", "disabled"]) -> Principal:
    return Principal(name=ANONYMOUS, role="admin", via=via)


def auth_disabled_warning(settings: Settings) -> str:
    return (
        f"WARNING: authentication is OFF (VLAB_API__AUTH=none): anyone who can reach "
        f"{settings.api.host}:{settings.api.port} can submit and cancel runs, change "
        "schedules and read engine logs, as an admin. Create a token "
        "(`vlab token create --name NAME --role admin`) and unset VLAB_API__AUTH."
    )


def startup_check(settings: Settings, session_factory: sessionmaker[Session]) -> str | None:
    """Refuse an unsafe configuration before the API listens.

    Returns a warning to log and print (``api.auth = "none"``), or None. Raises
    :class:`AuthSetupError` (one line) when the API would listen on a non-loopback
    address with no active token and authentication not explicitly turned off.
    """
    if settings.api.auth == "none":
        return auth_disabled_warning(settings)
    if is_loopback(settings.api.host):
        return None
    with session_factory() as session:
        if TokenRepository(session).any_active(utcnow()):
            return None
    raise AuthSetupError(
        f"refusing to listen on {settings.api.host or 'all interfaces'}: no API token "
        "exists, so anyone who reaches the port could control vlab. Create one first "
        "(`vlab token create --database --name NAME --role admin`), or set "
        "VLAB_API__AUTH=none to run without authentication."
    )


def set_actor(session: Session, actor: str | None) -> None:
    """Mark ``session``'s changes as made by ``actor`` (see :func:`_stamp`); None clears."""
    if actor is None:
        session.info.pop(ACTOR_KEY, None)
    else:
        session.info[ACTOR_KEY] = actor


def record(session: Session, principal: Principal, action: str, target: str) -> None:
    """Add an audit event for ``principal`` (committed with the caller's unit of work)."""
    AuditRepository(session).add(
        actor=principal.name,
        role=principal.role,
        token_id=principal.token_id,
        action=action,
        target=target[:2000],
    )


#: schedule fields a user changes (not the fire bookkeeping)
_SCHEDULE_SETTINGS = (
    "name",
    "cron",
    "timezone",
    "template",
    "enabled",
    "concurrency_policy",
    "catch_up",
    "end_at",
)


def _changed(obj: Any, attr: str) -> bool:
    return bool(inspect(obj).attrs[attr].history.has_changes())


@event.listens_for(Session, "before_flush")
def _stamp(session: Session, _flush_context: Any, _instances: Any) -> None:
    """Stamp who made the changes about to be flushed (the session's actor, if any)."""
    actor = session.info.get(ACTOR_KEY)
    if not actor:
        return
    for obj in session.new:
        if isinstance(obj, Experiment | Run | Campaign) and obj.submitted_by is None:
            obj.submitted_by = actor
        elif isinstance(obj, Schedule):
            obj.created_by = obj.created_by or actor
            obj.updated_by = obj.updated_by or actor
    for obj in session.dirty:
        if isinstance(obj, Run) and obj.cancelled_by is None:
            asked = obj.cancel_requested and _changed(obj, "cancel_requested")
            ended = obj.status == "cancelled" and _changed(obj, "status")
            if asked or ended:
                obj.cancelled_by = actor
        elif isinstance(obj, Schedule) and any(_changed(obj, a) for a in _SCHEDULE_SETTINGS):
            obj.updated_by = actor
