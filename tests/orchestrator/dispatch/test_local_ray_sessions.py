"""The session folders local Rays leave under ``<home>/ray`` are pruned when a service
starts its own (:func:`prune_local_ray_sessions`): ended ones but the newest
``KEEP_SESSIONS``; never one of a live service, nor one a process still has a file open in.
Real folders, a real record of a live owner (this process), a real process holding a log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs.engine.processes import LOCAL_RAY_OWNER_ENV, local_ray_marks
from orchestrator.dispatch.ray.localray import (
    KEEP_SESSIONS,
    RECORDS_DIR,
    prune_local_ray_sessions,
)


def make_sessions(root: Path, count: int) -> list[Path]:
    """``count`` session folders as Ray names them (oldest first), each with a log."""
    root.mkdir(parents=True, exist_ok=True)
    made = []
    for i in range(count):
        session = root / f"session_2026-12-0{i + 1}_10-00-00_123456_{1000 + i}"
        (session / "logs").mkdir(parents=True)
        (session / "logs" / "raylet.out").write_text("raylet log\n")
        made.append(session)
    (root / "session_latest").symlink_to(made[-1], target_is_directory=True)
    return made


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A process that opens the file named on its stdin and keeps it open until stdin
    closes (as a running Ray keeps its logs open)."""
    code = (
        "import sys\n"
        "f = open(sys.stdin.readline().strip())\n"
        "print('open', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


def test_ended_sessions_go_but_the_newest_and_the_running_ones(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    home = tmp_path / "home"
    sessions = make_sessions(home / "ray", 8)
    # the oldest belongs to a live service (this process), per its record
    records = home / RECORDS_DIR
    records.mkdir()
    owner = local_ray_marks(str(home))[LOCAL_RAY_OWNER_ENV]
    (records / f"{os.getpid()}.json").write_text(
        json.dumps({"owner": owner, "session_dir": str(sessions[0])})
    )
    # a dead service's record does not protect its session
    (records / "999999.json").write_text(
        json.dumps({"owner": "999999:1", "session_dir": str(sessions[2])})
    )
    # the second is in use by a process with no record (a Ray still starting, another home's)
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write(f"{sessions[1] / 'logs' / 'raylet.out'}\n")
    holder.stdin.flush()
    assert holder.stdout.readline().strip() == "open"

    removed = prune_local_ray_sessions(home)

    assert KEEP_SESSIONS == 3
    assert removed == sessions[2:5]
    left = sorted(p.name for p in (home / "ray").iterdir())
    assert left == sorted([p.name for p in (sessions[:2] + sessions[5:])] + ["session_latest"])
    assert (sessions[1] / "logs" / "raylet.out").read_text() == "raylet log\n"
    assert (home / "ray" / "session_latest").resolve() == sessions[-1]
    # nothing more to prune: a second start removes nothing
    assert prune_local_ray_sessions(home) == []


def test_few_sessions_and_no_folder_are_left_alone(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert prune_local_ray_sessions(home) == []  # no <home>/ray yet
    sessions = make_sessions(home / "ray", KEEP_SESSIONS)
    assert prune_local_ray_sessions(home) == []
    assert all(p.is_dir() for p in sessions)
    (home / "ray" / "other").mkdir()  # not Ray's session: never touched
    assert prune_local_ray_sessions(home, keep=1) == sessions[:2]
    assert (home / "ray" / "other").is_dir() and sessions[2].is_dir()


def test_a_linked_session_folder_is_pruned_through_the_link(tmp_path: Path) -> None:
    """A home too long for Ray's sockets keeps its sessions in a short folder elsewhere,
    ``<home>/ray`` a link to it (:func:`orchestrator.cli.runtime.local_ray_temp_dir`)."""
    home = tmp_path / "home"
    home.mkdir()
    short = tmp_path / "short" / "ray"
    sessions = make_sessions(short, 5)
    (home / "ray").symlink_to(short, target_is_directory=True)
    assert prune_local_ray_sessions(home) == sessions[:2]
    assert sorted(p.name for p in short.iterdir()) == sorted(
        [p.name for p in sessions[2:]] + ["session_latest"]
    )
    assert (home / "ray").is_symlink()
