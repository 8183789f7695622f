"""The local Ray a service starts (``RAY_ADDRESS`` unset or ``local``), and what a dead
one leaves behind.

Every process of a local Ray that a service starts carries two environment marks, its
``VLAB_HOME`` and the service itself (:func:`jobs.engine.processes.local_ray_marks`: GCS,
raylet, agents and workers inherit them, and so do the engines the workers start), and
the service notes the Ray session folder it started in
``<home>/local-ray/<pid>.json``. When the service dies (``kill -9``, out of memory),
Ray's GCS and raylet die with it (Ray's parent-death signal), its idle workers about a
second later; its dashboard and runtime-env agents live on for up to about a minute
(they report the raylet's death to the dead GCS first). The next service that starts
on the home ends them (:func:`end_dead_local_ray`) before it starts its own Ray.

The Ray session itself is under ``<home>/ray`` (``RAY_TMPDIR``, set around the start by
:func:`orchestrator.cli.runtime.local_ray_under_home`); a home too long for Ray's Unix
socket paths (at most 107 bytes) gets a short folder of its own under the system's temp
folder, linked from ``<home>/ray``. The record above points at it. Each start leaves a
``session_<time>_<pid>`` folder there (Ray's logs, its object spill); before it starts a
new one, a service removes those of the local Rays that no longer run but the newest
:data:`KEEP_SESSIONS` (:func:`prune_local_ray_sessions`): a session of a live service (its
record) or one a process still has a file open in is never touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import ray

from jobs.engine.processes import (
    LOCAL_RAY_OWNER_ENV,
    kill_processes,
    local_ray_marks,
    local_ray_processes,
    owner_alive,
    process_alive,
    process_start_time,
)
from orchestrator.core.settings import Settings
from orchestrator.dispatch.ray.supervisor import NAMESPACE

log = logging.getLogger(__name__)

#: ``<home>/local-ray/<pid>.json``: ``{"owner": "<pid>:<start>", "session_dir": ...}``
RECORDS_DIR = "local-ray"
#: Seconds between two looks of :func:`watch_local_raylet` at the raylet (``/proc``).
RAYLET_CHECK_INTERVAL_S = 0.2
#: Session folders of ended local Rays kept under ``<home>/ray`` for post-mortems (their
#: logs), the newest; older ones go when a service starts its local Ray.
KEEP_SESSIONS = 3


def start_local_ray(settings: Settings) -> None:
    """``ray.init`` a new local Ray (``address="local"``: never a Ray already running on
    this host), its processes marked as this service's, and note its session folder under
    the home."""
    home = settings.home.resolve()
    prune_local_ray_sessions(home)
    marks = local_ray_marks(str(home))
    with _environment(marks):
        ray.init(
            address="local",
            namespace=NAMESPACE,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    session = _started_session_dir()
    if session is None:
        return
    folder = home / RECORDS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    record = {"owner": marks[LOCAL_RAY_OWNER_ENV], "session_dir": session}
    (folder / f"{os.getpid()}.json").write_text(json.dumps(record))
    log.info("local Ray session: %s", session)


def forget_local_ray(home: Path) -> None:
    """Drop this process's record (its local Ray was shut down)."""
    with contextlib.suppress(OSError):
        (home.resolve() / RECORDS_DIR / f"{os.getpid()}.json").unlink()


def end_dead_local_ray(home: Path) -> list[int]:
    """SIGKILL what is left of the local Ray of every service of ``home`` that died;
    returns their pids. Only processes carrying a dead owner's marks, or retitled Ray
    processes (``ray::...``, whose environment is blanked) holding a file of a dead
    owner's session folder; each alone, never their process group (which may hold the
    shell or process manager that started both services). The dead owners' records go."""
    home = home.resolve()
    dead: list[tuple[Path, str]] = []
    for path, record in _records(home):
        if record is None:
            path.unlink(missing_ok=True)
        elif not owner_alive(record[0]):
            dead.append((path, record[1]))
    found = local_ray_processes(str(home), session_dirs=[s for _, s in dead])
    if found:
        log.warning(
            "ending %d processes of the local Ray of a dead service of %s: %s",
            len(found),
            home,
            ", ".join(f"{pid} ({title[:40]})" for pid, title in sorted(found.items())),
        )
        left = kill_processes(found, groups=False)
        if left:
            log.error("local Ray processes survived SIGKILL: %s", left)
    for path, _ in dead:
        path.unlink(missing_ok=True)
    return sorted(found)


def prune_local_ray_sessions(home: Path, keep: int = KEEP_SESSIONS) -> list[Path]:
    """Remove the session folders under ``<home>/ray`` (the link followed) of the local
    Rays that no longer run, but the ``keep`` newest of them; returns the folders removed.

    Never removed: ``session_latest`` (Ray's link), a session noted by a live service
    (``<home>/local-ray/<pid>.json``), and a session any process has a file open in (a
    running Ray holds its logs open: this covers a Ray whose service wrote no record yet,
    or of another home sharing the folder). "Newest" is the order of Ray's names
    (``session_<YYYY-MM-DD_HH-MM-SS_ffffff>_<pid>``). A folder that cannot be removed is
    logged and left."""
    home = home.resolve()
    root = (home / "ray").resolve()
    if not root.is_dir():
        return []
    sessions = sorted(
        p for p in root.iterdir() if p.name.startswith("session_") and not p.is_symlink()
    )
    sessions = [p for p in sessions if p.name != "session_latest" and p.is_dir()]
    if len(sessions) <= keep:
        return []
    live = _live_sessions(home)
    held = _held_folders(root, sessions)
    ended = [p for p in sessions if p not in live and p not in held]
    doomed = ended[: max(len(ended) - keep, 0)]
    removed: list[Path] = []
    for path in doomed:
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("cannot remove the old Ray session %s: %s", path, exc)
            continue
        removed.append(path)
    if removed:
        log.info(
            "removed %d session folder(s) of ended local Rays under %s (kept the newest %d)",
            len(removed),
            root,
            keep,
        )
    return removed


def _live_sessions(home: Path) -> set[Path]:
    """The session folders noted by the live services of ``home`` (resolved)."""
    return {
        Path(record[1]).resolve()
        for _, record in _records(home)
        if record is not None and owner_alive(record[0])
    }


def _records(home: Path) -> list[tuple[Path, tuple[str, str] | None]]:
    """The services' records of ``home`` (``<home>/local-ray/<pid>.json``), each with its
    ``(owner, session_dir)``, or None where the record cannot be read."""
    folder = home / RECORDS_DIR
    found: list[tuple[Path, tuple[str, str] | None]] = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            found.append((path, (str(record["owner"]), str(record["session_dir"]))))
        except (OSError, ValueError, KeyError, TypeError):
            found.append((path, None))
    return found


def _held_folders(root: Path, sessions: list[Path]) -> set[Path]:
    """Which of ``sessions`` (folders of ``root``) a process has a file open in, or its
    working folder in (``/proc``; other users' processes are unreadable and not seen)."""
    prefix = str(root) + "/"
    by_name = {p.name: p for p in sessions}
    held: set[Path] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        links: list[str] = []
        with contextlib.suppress(OSError):
            links.append(os.readlink(f"/proc/{entry.name}/cwd"))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry.name}/fd"):
                with contextlib.suppress(OSError):
                    links.append(os.readlink(f"/proc/{entry.name}/fd/{fd}"))
        for link in links:
            if link.startswith(prefix):
                session = by_name.get(link[len(prefix) :].split("/", 1)[0])
                if session is not None:
                    held.add(session)
    return held


def watch_local_raylet(
    on_death: Callable[[int], None], interval_s: float = RAYLET_CHECK_INTERVAL_S
) -> Callable[[], None] | None:
    """Watch the raylet of the local Ray this process started, in a daemon thread: when
    it exits while this process is still connected to that Ray, ``on_death(raylet pid)``
    is called once (in the thread). A raylet ended by ``ray.shutdown`` is not a death:
    shutdown disconnects first. Returns the function that ends the watch (call it before
    a clean shutdown); None when this process started no Ray (it joined one: the raylet
    is another's) or Ray is not initialized."""
    node = getattr(ray._private.worker, "_global_node", None)
    processes = getattr(node, "all_processes", None) or {}
    raylets = processes.get("raylet") or []  # ray_constants.PROCESS_TYPE_RAYLET
    if not raylets or not ray.is_initialized():
        return None
    pid = int(raylets[0].process.pid)
    started = process_start_time(pid)
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval_s):
            if process_alive(pid, started):
                continue
            if stop.is_set() or not ray.is_initialized():
                return  # a shutdown ended it (Ray disconnects before it kills its processes)
            if getattr(ray._private.worker, "_global_node", None) is not node:
                return  # another Ray was started since: this one was shut down
            on_death(pid)
            return

    threading.Thread(target=watch, name="local-raylet-watch", daemon=True).start()
    return stop.set


def _started_session_dir() -> str | None:
    """The session folder of the Ray this process started, None when it joined one."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not getattr(node, "all_processes", None):
        return None  # connected only: the processes are another's
    with contextlib.suppress(Exception):
        return str(node.get_session_dir_path())
    return None


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set for the block (what it starts inherits them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
