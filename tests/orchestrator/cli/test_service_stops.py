"""``vlab up``, ``serve`` and ``orchestrate`` as a process manager runs them (the fresh-user
trial): SIGTERM or Ctrl-C stops them cleanly with exit code 0 (systemd and Kubernetes read
15/143 as a failure), the embedded Postgres and the local Ray stopped, no process left;
a taken port is refused in one line before anything starts; the terminal shows vlab's
lines and where the service listens, uvicorn's start-up and access lines go to the log."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from jobs.engine.processes import local_ray_processes
from tests.faults.harness import VLAB, ServiceProcess, free_port, wait_for
from tests.orchestrator.cli.test_quiet import LOG, _env, short_home
from tests.orchestrator.dispatch.test_local_raylet_lost import _postgres_of

__all__ = ["short_home"]  # the fixture, imported for these tests


def _embedded_env(home: Path, **extra: str) -> dict[str, str]:
    """The service's environment on ``home`` with its embedded Postgres (no DATABASE_URL)."""
    env = _env(home, "", **extra)
    env.pop("DATABASE_URL")
    return env


def _session_members(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the service ran as its leader)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X") and int(fields[3]) == sid:
            found.append(int(entry.name))
    return found


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize(
    ("command", "sig"),
    [
        ("serve", signal.SIGTERM),
        ("serve", signal.SIGINT),
        ("up", signal.SIGTERM),
        ("up", signal.SIGINT),
        ("orchestrate", signal.SIGINT),
    ],
    ids=["serve-SIGTERM", "serve-Ctrl-C", "up-SIGTERM", "up-Ctrl-C", "orchestrate-Ctrl-C"],
)
def test_a_signal_stops_the_service_cleanly_with_exit_code_0(
    command: str, sig: signal.Signals, short_home: Path, tmp_path: Path
) -> None:
    home = short_home
    port = free_port()
    argv = [str(VLAB), command] + (["--port", str(port)] if command != "orchestrate" else [])
    env = _embedded_env(home, RAY_ADDRESS="local")
    service = ServiceProcess(argv, env, tmp_path / "terminal.log", tmp_path)
    pgdata = (home / "pgdata").resolve()
    base = f"http://127.0.0.1:{port}"
    ready = "a device is one of the cluster's" if command == "orchestrate" else "dashboard:"
    ray_session = ""
    try:
        service.start(lambda: ready in service.log_text(), timeout_s=240)
        if command != "orchestrate":
            assert wait_for(lambda: _healthy(base), 60), service.log_text()
        assert _postgres_of(pgdata), "the embedded Postgres is not running"
        if command != "serve":
            record = home / "local-ray" / f"{service.pid}.json"
            ray_session = json.loads(record.read_text())["session_dir"]
        service.kill(sig)
        assert service.proc is not None
        code = service.proc.wait(timeout=180)
        log = (home / LOG).read_text(errors="replace")
        assert code == 0, service.log_text()[-2000:] + log[-4000:]
        gone = wait_for(lambda: not _postgres_of(pgdata), 15)
        assert gone, f"the embedded Postgres outlived the exit: {_postgres_of(pgdata)}"
        left = wait_for(lambda: not _session_members(service.pid), 15)
        assert left, f"processes left in its session: {_session_members(service.pid)}"
        if ray_session:
            assert local_ray_processes(str(home), session_dirs=[ray_session]) == {}
            assert list((home / "local-ray").iterdir()) == []
    finally:
        service.close()
        for pid in _postgres_of(pgdata):
            os.kill(pid, signal.SIGKILL)
    terminal = service.log_text()
    said = [line for line in terminal.splitlines() if line.strip()]
    assert any(line.startswith(f"log: {(home / LOG).resolve()} ") for line in said), terminal
    if command != "orchestrate":
        assert said[-1] == (f"dashboard: {base}/ (API: {base}/api/v1, OpenAPI: {base}/docs)"), (
            terminal
        )
        # uvicorn's start-up and access lines are in the log, not on the terminal
        for line in ("Started server process", "Uvicorn running on", '"GET /healthz HTTP/1.1"'):
            assert line in log, (line, log[-3000:])
            assert line not in terminal, (line, terminal)
    assert "Waiting for application" not in terminal and "pixeltable" not in terminal, terminal


@pytest.mark.parametrize("command", ["up", "serve"])
def test_a_taken_port_is_refused_in_one_line_before_starting_anything(
    command: str, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(
            [str(VLAB), command, "--port", str(port)],
            cwd=tmp_path,
            env=_embedded_env(home, RAY_ADDRESS="local"),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"error: cannot serve on 127.0.0.1:{port}: Address already in use; pick another "
        "port with --port or VLAB_API__PORT"
    ], done.stderr
    assert done.stdout == "", done.stdout
    # nothing started: no database folder, no local Ray, nothing in the log
    assert not (home / "pgdata").exists()
    assert not (home / "local-ray").exists() and not (home / "ray").exists()
    log = home / LOG
    assert not log.exists() or log.read_text() == "", log.read_text()
