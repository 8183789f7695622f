"""Engine processes on this host, read from ``/proc``: liveness, groups, the owner marks.

Every engine process carries marks in its environment (:data:`OWNER_PID_ENV`,
:data:`OWNER_START_ENV`, :data:`RUN_ID_ENV`, :data:`HOME_ENV`); with them
:func:`engine_processes` finds what a run left on this machine and
:func:`kill_processes` ends it (a restarted service's start-up sweep). Every process
of a local Ray a service starts carries two more (:data:`LOCAL_RAY_HOME_ENV`,
:data:`LOCAL_RAY_OWNER_ENV`): :func:`local_ray_processes` finds a dead service's.
:class:`jobs.engine.server.EngineServer` uses the rest (:func:`group_members`,
:func:`process_alive`, :func:`process_title`, :func:`signal_name`...) to watch its
engine, and :func:`parent_death_preexec` when it starts it. Linux only (``/proc``);
no process is started here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import time
from collections.abc import Callable, Iterable

#: Environment of every engine process: the pid of the process that started the engine
#: (its owner: the run's supervisor) and that process's start time (clock ticks since boot,
#: ``/proc/<pid>/stat`` field 22), so a recycled pid is never taken for the owner. The
#: launcher (:mod:`jobs.launcher.vllm_launcher`) ends the engine's whole process group when the
#: owner is gone, in every vLLM process (API server, engine core, workers).
OWNER_PID_ENV = "VLAB_PARENT_PID"
OWNER_START_ENV = "VLAB_PARENT_START"
#: Marks every engine process of a run (set by the orchestrator), and of a ``VLAB_HOME``
#: (its absolute path), so a start-up sweep ends only the engines its own home started.
RUN_ID_ENV = "VLAB_RUN_ID"
HOME_ENV = "VLAB_ENGINE_HOME"

#: Helper processes in an engine's group that are not the engine: their coming and
#: going says nothing about the engine's health (matched against the command line).
HELPER_PROCESSES = re.compile(
    r"multiprocessing\.resource_tracker|multiprocessing\.forkserver|compile_worker"
)


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` from field 3 (state) on; None if there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields if len(fields) >= 20 else None


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` (clock ticks after boot, ``/proc/<pid>/stat`` field 22)."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields is not None else None


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, with ``start_time``, is still that process."""
    fields = _proc_stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return start_time is None or int(fields[19]) == start_time


def process_state(pid: int) -> str | None:
    """The state ``/proc/<pid>/status`` gives ``pid``: ``"S (sleeping)"``, ``"R (running)"``,
    ``"T (stopped)"`` (SIGSTOP), ``"D (disk sleep)"``...; None when there is no such pid."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for raw in fh:
                if raw.startswith(b"State:"):
                    return raw[6:].decode("ascii", "replace").strip()
    except OSError:
        return None
    return None


def process_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped now (state ``T`` or ``t``: SIGSTOP, a debugger)."""
    return (process_state(pid) or "").startswith(("T", "t"))


def process_title(pid: int) -> str:
    """What ``ps`` shows for ``pid``: its command line (vLLM retitles its processes
    ``VLLM::EngineCore``, ``VLLM::Worker``...), else its name; ``""`` when gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        if cmdline:
            return " ".join(cmdline.split())[:300]
        with open(f"/proc/{pid}/comm", "rb") as fh:
            return fh.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def process_env(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with (``/proc/<pid>/environ``); {} if unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return {}
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``, read from ``/proc``."""
    members: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _proc_stat(int(entry.name))
        # fields: state ppid pgrp ...
        if fields is not None and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def signal_name(code: int) -> str:
    """``"exited with code 3"`` or ``"was killed by signal SIGKILL"`` for a Popen return code."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = str(-code)
    return f"was killed by signal {name} (exit code {code})"


def engine_processes(home: str | None = None) -> dict[int, dict[str, str]]:
    """Engine processes on this machine (those carrying ``VLAB_RUN_ID``), read from ``/proc``.

    ``home``: only those of that ``VLAB_HOME`` (the :data:`HOME_ENV` marker, an absolute
    path). Returns ``{pid: {"run_id", "home", "owner_pid", "owner_start", "pgid",
    "title"}}``; processes whose environment cannot be read (other users') are skipped.
    """
    found: dict[int, dict[str, str]] = {}
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        env = process_env(pid)
        run_id = env.get(RUN_ID_ENV)
        if not run_id or (home is not None and env.get(HOME_ENV) != home):
            continue
        fields = _proc_stat(pid)
        if fields is None or fields[0] in ("Z", "X"):
            continue
        found[pid] = {
            "run_id": run_id,
            "home": env.get(HOME_ENV, ""),
            "owner_pid": env.get(OWNER_PID_ENV, ""),
            "owner_start": env.get(OWNER_START_ENV, ""),
            "pgid": fields[2],
            "title": process_title(pid),
        }
    return found


def kill_processes(
    pids: Iterable[int], timeout_s: float = 10.0, *, groups: bool = True
) -> list[int]:
    """SIGKILL ``pids`` and (with ``groups``) their process groups; wait until none is left.

    Returns the pids still alive after ``timeout_s`` seconds (normally none).
    """
    targets = {pid: process_start_time(pid) for pid in pids}
    pgids = (
        {int(f[2]) for pid in targets if (f := _proc_stat(pid)) is not None} if groups else set()
    )
    deadline = time.monotonic() + timeout_s
    while True:
        for pgid in pgids:
            if pgid > 1 and pgid != os.getpgid(0):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
        left = [pid for pid, start in targets.items() if process_alive(pid, start)]
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


#: Marks every process of a local Ray that a vlab service started (its GCS, raylet,
#: agents, workers and what they start, engines included: the variables are inherited):
#: the service's ``VLAB_HOME`` (absolute) and the service itself (``<pid>:<start time>``).
#: With them a service that starts on that home finds the local Ray of a predecessor
#: that died (:func:`local_ray_processes`); another user's Ray, a ``ray start`` cluster
#: or the Ray of a live service of the same home never carries a dead owner's mark.
LOCAL_RAY_HOME_ENV = "VLAB_LOCAL_RAY_HOME"
LOCAL_RAY_OWNER_ENV = "VLAB_LOCAL_RAY_OWNER"


def local_ray_marks(home: str, pid: int | None = None) -> dict[str, str]:
    """The environment marks of a local Ray that process ``pid`` (this one by default)
    starts for ``home``."""
    pid = os.getpid() if pid is None else pid
    return {LOCAL_RAY_HOME_ENV: home, LOCAL_RAY_OWNER_ENV: f"{pid}:{process_start_time(pid)}"}


def owner_alive(mark: str) -> bool:
    """Whether the process a :data:`LOCAL_RAY_OWNER_ENV` mark names still runs."""
    pid_text, _, start_text = mark.partition(":")
    try:
        pid = int(pid_text)
        start = int(start_text) if start_text.isdigit() else None
    except ValueError:
        return False
    return process_alive(pid, start)


def _holds_files_under(pid: int, folder: str) -> bool:
    """Whether ``pid`` has a file under ``folder`` open (``/proc/<pid>/fd``)."""
    prefix = folder.rstrip("/") + "/"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                return True
    return False


def local_ray_processes(
    home: str, owners: Iterable[str] = (), session_dirs: Iterable[str] = ()
) -> dict[int, str]:
    """Live processes of a local Ray started for ``home`` by a process that is gone:
    ``{pid: title}``. Found by their marks (a dead owner's; ``owners``: only those) or,
    for Ray's processes that retitle themselves (``ray::...``) and so blank their
    environment (the dashboard and runtime-env agents do), by a file open under one of
    ``session_dirs`` (the Ray session folders those owners started: their logs). Read
    from ``/proc``; other users' processes (unreadable) and those of a live owner are
    left out."""
    wanted, folders = set(owners), [d for d in session_dirs if d]
    found: dict[int, str] = {}
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        env = process_env(pid)
        owner = env.get(LOCAL_RAY_OWNER_ENV)
        marked = (
            owner is not None
            and env.get(LOCAL_RAY_HOME_ENV) == home
            and (not wanted or owner in wanted)
            and not owner_alive(owner)
        )
        if not marked and folders:
            marked = process_title(pid).startswith("ray::") and any(
                _holds_files_under(pid, d) for d in folders
            )
        if marked and process_alive(pid):
            found[pid] = process_title(pid)
    return found


_PR_SET_PDEATHSIG = 1


def parent_death_preexec(parent_pid: int) -> Callable[[], None]:
    """preexec_fn: SIGTERM on parent death (Linux ``PR_SET_PDEATHSIG``).

    SIGTERM, not SIGKILL: vLLM's API server then shuts its engine-core and
    worker processes down. This covers the launcher only (the signal follows
    the parent, and vLLM starts its engine core and workers itself); every
    vLLM process also runs the launcher's lifetime guard, which SIGKILLs the
    whole group within half a second once the owner (``VLAB_PARENT_PID``) is
    gone, whoever notices first.
    """

    # Resolved in the parent: the child of a threaded process should not dlopen.
    try:
        prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None

    def preexec() -> None:
        if prctl is None:
            return
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec
