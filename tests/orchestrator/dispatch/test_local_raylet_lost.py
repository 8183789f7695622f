"""A service whose local Ray's raylet dies exits, so that its process manager restarts it
(issue 23's fault matrix, the raylet row): ``vlab orchestrate`` and ``vlab up`` started
as a process manager starts them (their own session, a local Ray of their own), the
raylet they started SIGKILLed; each exits non-zero within a few seconds with one error
line. A raylet ended by ``ray.shutdown`` (a clean stop) is not taken for a death.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from orchestrator.cli.runtime import RAYLET_LOST_API_GRACE_S
from orchestrator.dispatch.ray.localray import RAYLET_CHECK_INTERVAL_S
from tests.conftest import REPO, fresh_database
from tests.faults.harness import VLAB, ServiceProcess, children, cmdline, free_port, wait_for

DIED = "local Ray's raylet (pid {pid}) died: exiting so that a process manager restarts"
#: From the raylet's kill to the service's exit: one look of the watch, the API's
#: grace, and slack for the loaded 2-core test machine.
EXIT_BOUND_S = RAYLET_CHECK_INTERVAL_S + RAYLET_LOST_API_GRACE_S + 5.0

#: Each test holds the service to an exit bound (and its Postgres to a stop bound): run with
#: the other wall-clock tests, by themselves (``make test``'s second pass).
pytestmark = pytest.mark.timing


def _raylet(pid: int) -> int | None:
    """The raylet among ``pid``'s children (the local Ray it started), or None."""
    return next((c for c in children(pid) if cmdline(c).split(" ", 1)[0].endswith("/raylet")), None)


@pytest.mark.parametrize("command", ["orchestrate", "up"])
def test_service_exits_when_its_local_raylet_dies(
    command: str, server_url: str, tmp_path: Path
) -> None:
    with fresh_database(server_url) as url:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "DATABASE_URL": url,
            "VLAB_HOME": str(tmp_path / "home"),
            "RAY_ADDRESS": "local",  # a Ray of its own
        }
        for var in ("VLAB_TOKEN", "VLAB_API__AUTH", "VIRTUAL_ENV"):
            env.pop(var, None)
        argv = [str(VLAB), command]
        if command == "up":
            argv += ["--port", str(free_port())]
        service = ServiceProcess(argv, env, tmp_path / "service.log", tmp_path)
        try:
            # printed once the start-up reconcile ran and the dispatcher thread started
            service.start(lambda: "device kind:" in service.log_text(), timeout_s=180)
            raylet = wait_for(lambda: _raylet(service.pid), 30)
            assert raylet, service.log_text()[-3000:]
            os.kill(raylet, signal.SIGKILL)
            t0 = time.monotonic()
            assert service.proc is not None
            exited = wait_for(lambda: service.proc.poll() is not None, EXIT_BOUND_S)
            took = time.monotonic() - t0
            log = service.log_text()
            assert exited, f"still running {took:.1f}s after its raylet's kill: {log[-3000:]}"
            print(f"vlab {command} exited {took:.2f}s after its raylet's SIGKILL", flush=True)
            assert service.proc.returncode != 0, log[-3000:]
            lines = [line for line in log.splitlines() if "local Ray's raylet" in line]
            assert len(lines) == 1, log[-3000:]
            assert "ERROR" in lines[0] and DIED.format(pid=raylet) in lines[0], lines
            assert (
                "the restart ends this orchestrator's runs, keeping what they measured"
                in (lines[0])
            )
        finally:
            service.close()


def _postgres_of(pgdata: Path) -> list[int]:
    """Pids of the postmasters serving ``pgdata``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            line = cmdline(int(entry.name))
            if "postgres" in line.split(" ", 1)[0] and str(pgdata) in line:
                found.append(int(entry.name))
    return found


def test_the_embedded_postgres_stops_when_the_raylet_dies(tmp_path: Path) -> None:
    """``vlab up`` on its embedded Postgres, run by hand (no process manager): the exit
    for a lost raylet stops the Postgres it started (``os._exit`` runs no atexit)."""
    home = tmp_path / "home"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "VLAB_HOME": str(home),
        "RAY_ADDRESS": "local",
    }
    for var in ("VLAB_TOKEN", "VLAB_API__AUTH", "VIRTUAL_ENV", "DATABASE_URL"):
        env.pop(var, None)
    argv = [str(VLAB), "up", "--port", str(free_port())]
    service = ServiceProcess(argv, env, tmp_path / "service.log", tmp_path)
    pgdata = (home / "pgdata").resolve()
    try:
        service.start(lambda: "device kind:" in service.log_text(), timeout_s=180)
        assert _postgres_of(pgdata), "the embedded Postgres is not running"
        raylet = wait_for(lambda: _raylet(service.pid), 30)
        assert raylet, service.log_text()[-3000:]
        os.kill(raylet, signal.SIGKILL)
        assert service.proc is not None
        assert wait_for(lambda: service.proc.poll() is not None, EXIT_BOUND_S + 10)
        assert service.proc.returncode != 0
        left = wait_for(lambda: not _postgres_of(pgdata), 15)
        assert left, f"embedded Postgres outlived the exit: {_postgres_of(pgdata)}"
    finally:
        service.close()
        for pid in _postgres_of(pgdata):
            os.kill(pid, signal.SIGKILL)


def test_a_shutdown_is_not_a_death(tmp_path: Path) -> None:
    """``ray.shutdown`` ends the raylet after it disconnects: the watch ends quietly."""
    import ray

    from orchestrator.core.settings import Settings
    from orchestrator.dispatch.ray.localray import (
        forget_local_ray,
        start_local_ray,
        watch_local_raylet,
    )

    if ray.is_initialized():
        pytest.skip("Ray is initialized in this process already (another test's)")
    settings = Settings(home=tmp_path / "home")
    start_local_ray(settings)
    deaths: list[int] = []
    try:
        before = set(threading.enumerate())
        unwatch = watch_local_raylet(deaths.append)
        assert unwatch is not None
        (watch,) = [t for t in threading.enumerate() if t not in before]
        raylet = ray._private.worker._global_node.all_processes["raylet"][0].process
    finally:
        ray.shutdown()
        forget_local_ray(settings.home)
    watch.join(timeout=30)
    assert not watch.is_alive()
    assert raylet.poll() is not None  # the shutdown ended it ...
    assert deaths == []  # ... and the watch did not take it for a death
