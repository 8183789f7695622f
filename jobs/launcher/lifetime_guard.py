"""The engine ends when its owner dies: a guard thread in every process of the engine."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

#: The process that owns the engine (the run's supervisor) and its start time
#: (``/proc/<pid>/stat`` field 22), set by ``jobs.engine.server.EngineServer``.
OWNER_PID_ENV = "VLAB_PARENT_PID"
OWNER_START_ENV = "VLAB_PARENT_START"
#: The process that started the local Ray the engine runs in (``<pid>:<start time>``; set
#: on every process of a local Ray a vlab service starts, ``jobs.engine.processes``), absent on
#: any other Ray. That Ray dies with that process (its GCS and raylet share its fate), so
#: the engine's owner is doomed too: the guard ends the engine when either is gone, not
#: only once Ray's worker noticed its raylet's death (measured: 1.6-2.1 s).
LOCAL_RAY_OWNER_ENV = "VLAB_LOCAL_RAY_OWNER"
#: Seconds between two looks at the owner.
GUARD_INTERVAL_S = 0.5
_guard_forks_hooked = False


def _owner_alive(pid: int, start: int | None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, with ``start``, is still that process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat_line = fh.read().decode("ascii", "replace")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    fields = stat_line[stat_line.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return False
    return start is None or len(fields) < 20 or int(fields[19]) == start


def _end_engine(owner: int) -> None:
    """SIGKILL this process's whole group (the engine: API server, engine core, workers)."""
    with contextlib.suppress(OSError):
        os.write(
            2,
            f"vlab: the process that owns this engine (pid {owner}) is gone; "
            f"pid {os.getpid()} ends the engine's process group\n".encode(),
        )
    with contextlib.suppress(OSError):
        pgid = os.getpgid(0)
        try:
            with open(f"/proc/{pgid}/environ", "rb") as fh:
                leader_env = fh.read().split(b"\0")
        except FileNotFoundError:  # the leader (launcher) is gone: the group is the engine's
            leader_env = None
        # the group is the engine's own session (jobs.engine.server starts it in a new one), never
        # a group this process merely joined
        if pgid > 1 and (leader_env is None or f"{OWNER_PID_ENV}={owner}".encode() in leader_env):
            os.killpg(pgid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _start_guard_thread() -> None:
    try:
        owner = int(os.environ.get(OWNER_PID_ENV, "0"))
        start_text = os.environ.get(OWNER_START_ENV, "")
        start = int(start_text) if start_text else None
    except ValueError:
        return
    if owner <= 0 or owner == os.getpid():
        return
    ray_pid, _, ray_start = os.environ.get(LOCAL_RAY_OWNER_ENV, "").partition(":")
    ray_owner = (
        (int(ray_pid), int(ray_start) if ray_start.isdigit() else None)
        if ray_pid.isdigit() and int(ray_pid) != os.getpid()
        else None
    )

    def watch() -> None:
        while _owner_alive(owner, start) and (ray_owner is None or _owner_alive(*ray_owner)):
            time.sleep(GUARD_INTERVAL_S)
        _end_engine(owner)

    threading.Thread(target=watch, name="vlab-lifetime-guard", daemon=True).start()


def install_lifetime_guard() -> bool:
    """End the engine when its owner dies, whatever killed the owner; True when installed.

    With ``VLAB_PARENT_PID`` set (every process of an engine that ``jobs.engine.server``
    started: the variable is inherited), a daemon thread looks at the owner every
    :data:`GUARD_INTERVAL_S` seconds and, once it is gone (or its pid now names
    another process: ``VLAB_PARENT_START``), or the process that started the local Ray
    it runs in is (:data:`LOCAL_RAY_OWNER_ENV`), SIGKILLs the whole process group.
    Installed when the launcher is loaded, so it runs in the launcher (vLLM's API
    server), in every process vLLM *spawns* (they re-run
    :mod:`jobs.launcher.vllm_launcher` as ``__mp_main__``) and, through
    ``os.register_at_fork``, in every process it *forks* (the engine core and its
    workers on CPU); any one of them that notices ends them all. The
    launcher's parent-death signal covers the launcher alone: vLLM starts the
    others itself, and a parent-death signal would follow their parent thread.
    """
    global _guard_forks_hooked
    if not os.environ.get(OWNER_PID_ENV):
        return False
    _start_guard_thread()
    if not _guard_forks_hooked and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_start_guard_thread)
        _guard_forks_hooked = True
    return True
