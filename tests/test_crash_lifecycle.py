"""Lifecycles after a crash, on real parts: ``vlab up`` (the real command, its embedded
Postgres in ``<home>/pgdata``, a local Ray of its own) is SIGKILLed, then started again
on the same home and stopped with SIGTERM, as a process manager would.

- the crash leaves its registration with pgserver (the registry of the processes using
  the embedded Postgres) and the processes of its local Ray (GCS and raylet die with it;
  its dashboard and runtime-env agents and its workers do not);
- the restarted service drops the dead registration and ends what is left of the dead
  service's Ray before it serves;
- its clean exit stops the embedded Postgres (pgserver stops it when its last user
  leaves: after a crash that never happened, as the dead pid stayed registered).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from jobs.engine.processes import (
    LOCAL_RAY_OWNER_ENV,
    local_ray_processes,
    process_alive,
    process_env,
    process_title,
)
from orchestrator.core.db import embedded_registrations
from tests.conftest import REPO
from tests.ports import free_port as _free_port

VLAB = Path(sys.executable).parent / "vlab"


def _ray_of(home: Path, pid: int) -> dict[int, str]:
    """Live processes of the local Ray that service ``pid`` started: its marks, or a
    retitled Ray process holding a file of its session (read from its record)."""
    record = json.loads((home / "local-ray" / f"{pid}.json").read_text())
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and process_alive(int(entry.name)):
            mark = process_env(int(entry.name)).get(LOCAL_RAY_OWNER_ENV)
            if mark == record["owner"]:
                found[int(entry.name)] = process_title(int(entry.name))[:40]
    dead_owner = local_ray_processes(
        str(home), owners=[record["owner"]], session_dirs=[record["session_dir"]]
    )
    return found | {pid: title[:40] for pid, title in dead_owner.items()}


def _watch_gone(home: Path, record: dict[str, str], gone_at: list[float]) -> None:
    """Append the time the dead service's Ray processes are all gone (the restart's
    sweep ends them), polling every 0.1 s for at most 5 minutes."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if not local_ray_processes(
            str(home), owners=[record["owner"]], session_dirs=[record["session_dir"]]
        ):
            gone_at.append(time.monotonic())
            return
        time.sleep(0.1)


def _postmaster(pgdata: Path) -> int | None:
    """The postmaster's pid from ``postmaster.pid``, when that file is there."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((pgdata / "postmaster.pid").read_text().splitlines()[0])
    return None


class Up:
    """``vlab up`` in its own session; ready once its API answers (after the start-up
    sweep, the dispatcher's start and the database's)."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = _free_port()
        self.out = log.open("ab")
        self.log = log
        self.proc = subprocess.Popen(
            [str(VLAB), "up", "--port", str(self.port)],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 180
        while not self._answers():
            assert self.proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.1)

    def _answers(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=5).is_success
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        """SIGKILL whatever is left of its session (a failed test's leftovers)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.out.close()


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "home"
    yield home
    pid = _postmaster(home / "pgdata")  # a failed test's Postgres: stop it
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGQUIT)


def test_a_service_restarted_after_a_crash_cleans_up_and_stops_postgres_when_it_exits(
    home: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}  # the embedded one
    env |= {
        "PYTHONPATH": str(REPO),
        "VLAB_HOME": str(home),
        "RAY_ADDRESS": "local",  # a Ray of its own, never another test's
    }
    home = home.resolve()
    pgdata = home / "pgdata"
    first = Up(env, tmp_path / "up1.log")
    second: Up | None = None
    try:
        postmaster = _postmaster(pgdata)
        assert postmaster is not None and process_alive(postmaster)
        assert embedded_registrations(pgdata) == [first.proc.pid]
        assert _ray_of(home, first.proc.pid), "the local Ray carries its owner's mark"

        first.proc.kill()
        first.proc.wait(timeout=30)
        t_kill = time.monotonic()
        # what the crash leaves: its registration, and (for a while) some of its Ray
        assert embedded_registrations(pgdata) == [first.proc.pid]
        assert process_alive(postmaster)
        record = json.loads((home / "local-ray" / f"{first.proc.pid}.json").read_text())
        left_by_crash = _ray_of(home, first.proc.pid)
        assert left_by_crash, "nothing of the dead service's Ray is left to clean"

        gone_at: list[float] = []
        watch = threading.Thread(
            target=_watch_gone, args=(home, record, gone_at), name="watch", daemon=True
        )
        watch.start()
        second = Up(env, tmp_path / "up2.log")
        restart_s = time.monotonic() - t_kill
        watch.join(timeout=30)
        assert gone_at, "the dead service's Ray outlived the restart's sweep"
        assert _postmaster(pgdata) == postmaster  # the same server, reused
        assert embedded_registrations(pgdata) == [second.proc.pid]
        log = second.log.read_text(errors="replace")
        assert "dropped the registrations of 1 processes that are gone" in log, log[-3000:]
        assert (
            local_ray_processes(
                str(home), owners=[record["owner"]], session_dirs=[record["session_dir"]]
            )
            == {}
        ), f"the dead service's Ray outlived the restart: {log[-3000:]}"
        assert not (home / "local-ray" / f"{first.proc.pid}.json").exists()

        # a clean exit (SIGTERM, as a process manager stops it) stops the Postgres
        second.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        # 0: a process manager's stop is a clean exit (uvicorn re-raises the SIGTERM it
        # handled; the service's own handler ends the command and its clean-up runs)
        assert second.proc.wait(timeout=120) == 0, log[-3000:]
        exit_s = time.monotonic() - t_term
        # pg_ctl stop -w returned before the service exited: nothing to wait for
        assert not process_alive(postmaster), "the embedded Postgres outlived a clean exit"
        assert _postmaster(pgdata) is None
        assert embedded_registrations(pgdata) == []
        assert list((home / "local-ray").iterdir()) == []
        print(
            f"crash left {len(left_by_crash)} Ray processes "
            f"({', '.join(sorted(set(left_by_crash.values())))}), gone "
            f"{gone_at[0] - t_kill:.1f} s after the kill; restart ready {restart_s:.1f} s "
            f"after the kill; clean exit in {exit_s:.1f} s with Postgres stopped"
        )
    finally:
        for service in (first, second):
            if service is not None:
                service.close()
