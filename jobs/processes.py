"""Engine processes on this host, read from ``/proc``: liveness, groups, the owner marks.

Every engine process carries marks in its environment (:data:`OWNER_PID_ENV`,
:data:`OWNER_START_ENV`, :data:`RUN_ID_ENV`, :data:`HOME_ENV`); with them
:func:`engine_processes` finds what a run left on this machine and
:func:`kill_processes` ends it (a restarted service's start-up sweep).
:class:`jobs.engine.EngineServer` uses the rest (:func:`group_members`,
:func:`process_alive`, :func:`process_title`, :func:`signal_name`...) to watch its
engine. Linux only (``/proc``); no process is started here.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterable

#: Environment of every engine process: the pid of the process that started the engine
#: (its owner: the run's supervisor) and that process's start time (clock ticks since boot,
#: ``/proc/<pid>/stat`` field 22), so a recycled pid is never taken for the owner. The
#: launcher (:mod:`jobs.vllm_launcher`) ends the engine's whole process group when the
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


def kill_processes(pids: Iterable[int], timeout_s: float = 10.0) -> list[int]:
    """SIGKILL ``pids`` and their process groups; wait until none is left.

    Returns the pids still alive after ``timeout_s`` seconds (normally none).
    """
    targets = {pid: process_start_time(pid) for pid in pids}
    groups = {int(f[2]) for pid in targets if (f := _proc_stat(pid)) is not None}
    deadline = time.monotonic() + timeout_s
    while True:
        for pgid in groups:
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
