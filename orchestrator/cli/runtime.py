"""Process wiring: database (embedded or external), migrations, Ray, dispatcher, API server.

Used by the CLI (``vlab up``, ``vlab serve``, ``vlab orchestrate``, ``vlab demo``)
and by the integration tests, so every entry point starts the same way; also the
commands' own work on the database (the token of ``vlab token create --database``, the
demo's token, the auth check before a service starts). Heavy (the API's app with every
route, the dispatcher, SQLAlchemy): the CLI loads it only in the commands that start a
service or open the database, never in the API's client commands.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import logging
import os
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from api.routes import metrics as metrics_routes
from orchestrator.cli.client import TOKEN_ENV
from orchestrator.cli.common import one_line
from orchestrator.cli.logsetup import adopt_library_loggers
from orchestrator.cli.specfile import CliError
from orchestrator.core import auth
from orchestrator.core.db import (
    make_engine,
    make_session_factory,
    resolve_database_url,
    stop_embedded_postgres,
    unit_of_work,
    upgrade_to_head,
)
from orchestrator.core.errors import TokenError
from orchestrator.core.repositories import AuditRepository, TokenRepository, utcnow
from orchestrator.core.settings import Settings
from orchestrator.dispatch.dispatcher import Dispatcher
from orchestrator.experiments.model_resolution import set_model_locator

log = logging.getLogger(__name__)

#: The exit status of a process whose local Ray's raylet died (:meth:`Runtime._ray_lost`).
RAYLET_LOST_EXIT_CODE = 1
#: How long the API servers get to stop before that exit (the process exits regardless).
RAYLET_LOST_API_GRACE_S = 3.0
#: The longest Unix socket path Linux takes (108 bytes with the terminating NUL).
UNIX_SOCKET_MAX = 107
#: What Ray adds to its temp folder for its longest socket path:
#: ``/session_<YYYY-MM-DD_HH-MM-SS_ffffff>_<pid>/sockets/plasma_store`` is 64 bytes with a
#: 7-digit pid (Ray 2.60, ``ray/_private/node.py``); 6 more for a margin.
RAY_SOCKET_ROOM = 70


def local_ray_temp_dir(home: Path) -> tuple[Path, str]:
    """Where a local Ray of ``home`` keeps its sessions: ``(RAY_TMPDIR, note)``; Ray's
    temp folder is ``RAY_TMPDIR/ray``. That is ``<home>/ray`` when its socket paths fit
    :data:`UNIX_SOCKET_MAX`; otherwise a folder of this user and home under the system's
    temp folder (``vlab-<uid>-<hash of the home>``), with ``<home>/ray`` a link to it.
    ``note`` says which, in a line."""
    home = home.resolve()
    if len(str(home / "ray").encode()) + RAY_SOCKET_ROOM <= UNIX_SOCKET_MAX:
        return home, f"Ray's session folder: {home / 'ray'}"
    digest = hashlib.sha256(str(home).encode()).hexdigest()[:12]
    tmp = Path(tempfile.gettempdir())
    if len(str(tmp).encode()) + 40 + RAY_SOCKET_ROOM > UNIX_SOCKET_MAX:
        tmp = Path("/tmp")  # TMPDIR too long as well
    short = tmp / f"vlab-{os.getuid()}-{digest}"
    with contextlib.suppress(FileExistsError):
        short.mkdir(mode=0o700)
    info = short.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise OSError(f"{short} is not a folder of this user")
    link = home / "ray"
    target = short / "ray"
    target.mkdir(exist_ok=True)
    if link.is_symlink() and Path(os.readlink(link)) != target:
        link.unlink()
    if not link.exists() and not link.is_symlink():
        link.symlink_to(target, target_is_directory=True)
    return short, (
        f"Ray's session folder: {target} (linked from {link}: the home's path is too long "
        f"for Ray's Unix sockets, at most {UNIX_SOCKET_MAX} bytes)"
    )


@contextlib.contextmanager
def local_ray_under_home(settings: Settings) -> Iterator[None]:
    """``RAY_TMPDIR`` set for the block (the local Ray started in it keeps its session
    under the home: :func:`local_ray_temp_dir`), unless Ray joins a cluster (its
    sessions are the cluster's) or ``RAY_TMPDIR`` is set already (the user's choice)."""
    address = (settings.ray_address or "").strip()
    if (address and address != "local") or os.environ.get("RAY_TMPDIR"):
        yield
        return
    try:
        folder, note = local_ray_temp_dir(settings.home)
    except OSError as exc:
        log.warning("Ray's session folder stays Ray's default (%s)", exc)
        yield
        return
    log.info("%s", note)
    os.environ["RAY_TMPDIR"] = str(folder)
    try:
        yield
    finally:
        os.environ.pop("RAY_TMPDIR", None)


@dataclass
class Runtime:
    settings: Settings
    url: str = ""
    engine: Engine | None = None
    session_factory: sessionmaker[Session] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _servers: list[uvicorn.Server] = field(default_factory=list)
    dispatcher: Dispatcher | None = None
    #: (device kind, "detected" | "setting") once the orchestrator is connected to Ray
    device_kind: tuple[str, str] | None = None
    #: the embedded Postgres's data folder, when this process started (or joined) it
    pgdata: Path | None = None
    #: the API server :meth:`serve_api_foreground` runs, while it runs
    _foreground: uvicorn.Server | None = None
    #: ends the watch of the local Ray's raylet (None: this process started no Ray)
    _unwatch_raylet: Callable[[], None] | None = None
    #: set when the local Ray's raylet died: the process is exiting
    _raylet_lost: threading.Event = field(default_factory=threading.Event)

    @property
    def sessions(self) -> sessionmaker[Session]:
        """The session factory; :meth:`start_database` must have run."""
        assert self.session_factory is not None, "start_database() first"
        return self.session_factory

    def start_database(self) -> sessionmaker[Session]:
        """Resolve the database (starting the embedded one if needed) and migrate to head."""
        self.settings.home.mkdir(parents=True, exist_ok=True)
        if not self.settings.database_url:
            self.pgdata = self.settings.home / "pgdata"
        self.url = resolve_database_url(self.settings)
        upgrade_to_head(self.url)
        self.engine = make_engine(self.url)
        self.session_factory = make_session_factory(self.engine)
        return self.session_factory

    def start_orchestrator(self) -> None:
        """Connect to Ray (or start it locally) and run the dispatcher in a thread.

        First, what is left of the local Ray of a service of this home that died is
        ended (:func:`orchestrator.dispatch.ray.localray.end_dead_local_ray`).

        The dispatcher's start-up (:meth:`orchestrator.dispatch.dispatcher.Dispatcher.startup`)
        runs here, before the thread: when this returns, the runs a dead predecessor
        left are adopted or failed (with what they measured) and no orphaned engine
        process of this ``VLAB_HOME`` is left.

        When this process started a local Ray, its raylet is watched: when it dies the
        process exits (:meth:`_raylet_died`), so that a process manager restarts it."""
        # deferred: these import ray (heavy), which an API-only process (`vlab serve`) never loads
        from orchestrator.dispatch.ray.backend import RayRunBackend, connect
        from orchestrator.dispatch.ray.localray import end_dead_local_ray, watch_local_raylet
        from orchestrator.dispatch.ray.model_locator import locate_on_cluster

        assert self.session_factory is not None
        adopt_library_loggers()  # Ray's logger: into the service's log, not the terminal
        end_dead_local_ray(self.settings.home)
        with local_ray_under_home(self.settings):
            resources = connect(self.settings)
        self._unwatch_raylet = watch_local_raylet(self._raylet_died)
        log.info("ray cluster resources: %s", resources)
        backend = RayRunBackend(self.settings)
        self.device_kind = (backend.resource, backend.resource_source)
        # model ids are resolved on a node of the cluster, not on this host
        set_model_locator(locate_on_cluster)
        dispatcher = Dispatcher(self.settings, self.session_factory, backend)
        self.dispatcher = dispatcher
        # before anything starts: adopt or fail what a dead predecessor left, and kill every
        # engine process of this home that no live run owns
        dispatcher.startup()
        t = threading.Thread(
            target=dispatcher.run_forever, args=(self._stop,), name="dispatcher", daemon=True
        )
        t.start()
        self._threads.append(t)

    def make_app(self) -> FastAPI:
        assert self.session_factory is not None
        return create_app(self.settings, self.session_factory)

    def start_api_thread(self, host: str, port: int) -> uvicorn.Server:
        """Serve the API in a background thread; returns once it accepts connections."""
        return self._serve_in_thread(self.make_app(), host, port, "api")

    def start_metrics_thread(self, host: str, port: int) -> uvicorn.Server:
        """Serve ``GET /metrics`` alone (:mod:`api.routes.metrics`, the same series and
        token rule as the API's) in a background thread: ``vlab orchestrate
        --metrics-port``, whose dispatcher's series no API process exports."""
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        app.state.settings = self.settings
        app.state.session_factory = self.sessions
        app.include_router(metrics_routes.router)
        return self._serve_in_thread(app, host, port, "metrics")

    def _serve_in_thread(self, app: FastAPI, host: str, port: int, name: str) -> uvicorn.Server:
        # log_config None: uvicorn's records go through the service's logging (logsetup)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", log_config=None)
        server = uvicorn.Server(config)
        t = threading.Thread(target=server.run, name=name, daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not t.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{name} server did not start on {host}:{port}")
            time.sleep(0.05)
        self._servers.append(server)
        self._threads.append(t)
        return server

    def serve_api_foreground(self, host: str, port: int) -> None:
        """Serve the API until Ctrl-C or SIGTERM (what ``uvicorn.run`` does), or until
        the local Ray's raylet dies (:meth:`_raylet_died` stops it)."""
        server = uvicorn.Server(
            # log_config None: its start-up and access lines go through the service's
            # logging (the log file; the terminal shows its errors: logsetup)
            uvicorn.Config(self.make_app(), host=host, port=port, log_level="info", log_config=None)
        )
        self._foreground = server
        try:
            with contextlib.suppress(KeyboardInterrupt):
                server.run()
        finally:
            self._foreground = None
        if not server.started and not self._raylet_lost.is_set():
            sys.exit(3)  # uvicorn's STARTUP_FAILURE, as uvicorn.run exits

    def _raylet_died(self, pid: int) -> None:
        """The local Ray's raylet this process started died (in the watch's thread): one
        error line, the API servers stopped (a few seconds at most), then the process
        exits non-zero at once, without the dispatcher's shutdown (its Ray calls would
        wait on the dead raylet). The restarted service's start-up reconcile fails this
        orchestrator's runs keeping what they measured, and ends what is left of its Ray
        and its embedded Postgres registration."""
        self._raylet_lost.set()
        log.error(
            "local Ray's raylet (pid %d) died: exiting so that a process manager restarts "
            "the orchestrator; the restart ends this orchestrator's runs, keeping what "
            "they measured",
            pid,
        )
        self._exit_for_lost_ray()

    def _exit_for_lost_ray(self) -> None:
        """Stop the API servers (for :data:`RAYLET_LOST_API_GRACE_S` at most) and the
        embedded Postgres this process started, flush the logs and ``os._exit``: nothing
        that waits on Ray runs."""
        deadline = time.monotonic() + RAYLET_LOST_API_GRACE_S
        servers = [*self._servers, *([self._foreground] if self._foreground else [])]
        for server in servers:
            server.should_exit = True
        for t in self._threads:
            if t.name in ("api", "metrics"):
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        while self._foreground is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # the main thread's server is stopping
        if self.pgdata is not None:
            # the embedded Postgres this process started stops with it (no process manager
            # may restart the service; os._exit runs no atexit handler that would stop it)
            try:
                if self.engine is not None:
                    self.engine.dispose()
                stop_embedded_postgres(self.pgdata)
            except Exception:  # noqa: BLE001 - exiting anyway; the next start prunes it
                log.exception("stopping the embedded Postgres failed")
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(RAYLET_LOST_EXIT_CODE)

    def stop(self) -> None:
        """Stop the API threads and the dispatcher (active runs are cancelled and recorded),
        then the embedded Postgres unless another live process uses it. When the local
        Ray's raylet died, the process exits instead (:meth:`_raylet_died`)."""
        if self._raylet_lost.is_set():
            self._exit_for_lost_ray()
        if self._unwatch_raylet is not None:
            self._unwatch_raylet()  # the clean shutdown below ends the raylet
            self._unwatch_raylet = None
        for server in self._servers:
            server.should_exit = True
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        if self.dispatcher is not None:
            # deferred: imports ray (heavy); loaded already when a dispatcher ran
            from orchestrator.dispatch.ray.backend import disconnect
            from orchestrator.dispatch.ray.localray import forget_local_ray

            set_model_locator(None)
            disconnect()
            forget_local_ray(self.settings.home)
        if self.engine is not None:
            self.engine.dispose()
        if self.pgdata is not None:
            # stopped now if no other live process uses it (pgserver's own rule, after the
            # registrations of dead processes are dropped), not only at interpreter exit
            stop_embedded_postgres(self.pgdata)
            self.pgdata = None


def safe_url(url: str) -> str:
    """The database URL without its password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url.split("@")[-1]


def open_runtime(settings: Settings) -> Runtime:
    """A :class:`Runtime` with its database started and migrated; an unreachable database
    is a :class:`CliError` naming it (without its password)."""
    rt = Runtime(settings)
    try:
        rt.start_database()
    except OperationalError as exc:
        rt.stop()
        reason = str(exc.orig) if exc.orig is not None else str(exc)
        first = (reason.strip().splitlines() or [type(exc).__name__])[0]
        url = settings.database_url or rt.url or "(embedded)"
        raise CliError(f"cannot reach the database at {safe_url(url)}: {one_line(first)}") from None
    return rt


def cli_actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # noqa: BLE001 - no user name (containers): still say where it came from
        return "cli"


def auth_warning(settings: Settings, rt: Runtime) -> str | None:
    """The loud warning of ``VLAB_API__AUTH=none`` (None: nothing to say); a service that
    may not start (a non-loopback address without a token) is a :class:`CliError`."""
    try:
        return auth.startup_check(settings, rt.sessions)
    except auth.AuthSetupError as exc:
        raise CliError(str(exc)) from None


def create_token_in_database(
    settings: Settings, name: str, role: str, expires_in_days: float | None
) -> dict[str, Any]:
    """The bootstrap path of ``vlab token create --database``: the token written in the
    configured database (started for the command, stopped after)."""
    rt = open_runtime(settings)
    try:
        actor = cli_actor()
        with unit_of_work(rt.sessions) as session:
            token, secret = auth.create_token(
                session,
                name=name,
                role=role,
                created_by=actor,
                expires_at=utcnow() + timedelta(days=expires_in_days) if expires_in_days else None,
            )
            AuditRepository(session).add(actor=actor, action="token.create", target=name)
            made = {
                "id": token.id,
                "name": token.name,
                "role": token.role,
                "key_id": token.key_id,
                "token": secret,
            }
    except TokenError as exc:
        raise CliError(exc.detail) from None
    finally:
        rt.stop()
    return made


def create_demo_token(rt: Runtime) -> str | None:
    """When tokens exist and ``VLAB_TOKEN`` is unset: a one-day operator token for the
    demo's own API calls (revoked when it ends: :func:`revoke_demo_token`), set as
    ``VLAB_TOKEN``; returns its id, or None."""
    if os.environ.get(TOKEN_ENV):
        return None
    with unit_of_work(rt.sessions) as session:
        if not TokenRepository(session).any_active(utcnow()):
            return None
        token, secret = auth.create_token(
            session,
            name=f"demo-{os.getpid()}-{int(utcnow().timestamp())}",
            role="operator",
            created_by=cli_actor(),
            expires_at=utcnow() + timedelta(days=1),
        )
        token_id = token.id
    os.environ[TOKEN_ENV] = secret
    return token_id


def revoke_demo_token(rt: Runtime, token_id: str) -> None:
    os.environ.pop(TOKEN_ENV, None)
    with unit_of_work(rt.sessions) as session:
        auth.revoke_token(session, token_id, by="demo")
