"""An engine stopped (SIGSTOP) outside the measurement (issue 23's fault matrix:
``engine/STOP/recording``, ``engine/STOP/starting``).

- :meth:`jobs.engine.server.EngineServer.stop` SIGKILLs the group as soon as a process of it is
  stopped while the stop waits for the engine's drain (a stopped engine cannot shut down
  gracefully), and still gives a healthy engine its whole drain;
- :meth:`jobs.engine.server.EngineServer.wait_healthy` fails a start whose process stays stopped
  for ``stopped_after_s`` (the runner: :data:`jobs.run.enginewatch.HANG_AFTER_S`), not at the
  start-up timeout, with the engine's warning and error lines and never an access line;
  a stop that ends before the bound does not fail the start; a run whose engine is
  stopped while it starts fails within the hang bound.

The engines are test doubles standing in for the engine venv's python: small scripts
that drain on SIGTERM or never become healthy, and the project's stub server
(:mod:`jobs.stub.stubserver`). No fixed sleeps: every wait polls a condition with a deadline.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from jobs.engine.processes import group_members, process_alive, process_stopped
from jobs.engine.server import DEAD_ENGINE_GRACE_S, EngineServer, EngineStartError
from jobs.run import enginewatch
from jobs.run.runner import execute_batch
from jobs.schemas import (
    BatchJob,
    EngineLaunch,
    RunSegment,
    WorkloadSpec,
)

REPO = Path(__file__).resolve().parents[2]
WARNING = "WARNING 12-05 10:00:00 [cpu.py:224] fake engine: the KV cache space is small"
ACCESS = 'INFO:     127.0.0.1:45678 - "GET /health HTTP/1.1" 503 Service Unavailable'
LOADING = "INFO 12-05 10:00:00 [loader.py:1] fake engine loading the model"

# A process group of two like vLLM's (API server and engine core): each drains for
# DRAIN_S seconds on SIGTERM, saying so in the log, then exits 0.
DRAINING_ENGINE = """\
#!{python}
# TEST DOUBLE for the engine venv's python: never healthy; drains on SIGTERM.
import signal, subprocess, sys, time
DRAIN_S = {drain_s!r}
def drain(*_):
    print("INFO api server draining", flush=True)
    time.sleep(DRAIN_S)
    child.wait(timeout=DRAIN_S + 60)
    sys.exit(0)
child = subprocess.Popen([{python!r}, {core!r}, str(DRAIN_S)])
signal.signal(signal.SIGTERM, drain)
print({warning!r}, flush=True)
print({access!r}, flush=True)
print({loading!r}, flush=True)
while True:
    time.sleep(0.2)
"""

ENGINE_CORE = """\
import signal, sys, time
DRAIN_S = float(sys.argv[1])
def drain(*_):
    print("INFO engine core draining", flush=True)
    time.sleep(DRAIN_S)
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
print("INFO engine core up", flush=True)
while True:
    time.sleep(0.2)
"""


def _engine(tmp_path: Path, drain_s: float) -> str:
    core = tmp_path / "engine_core.py"
    core.write_text(ENGINE_CORE)
    path = tmp_path / "draining_engine"
    path.write_text(
        DRAINING_ENGINE.format(
            python=sys.executable,
            core=str(core),
            drain_s=drain_s,
            warning=WARNING,
            access=ACCESS,
            loading=LOADING,
        )
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _launch(tmp_path: Path, engine_python: str, **kw: object) -> EngineLaunch:
    doc: dict[str, object] = {
        "engine_python": engine_python,
        "model_dir": str(tmp_path / "model"),
        "served_model_name": "m",
        "port": 0,
        "log_path": str(tmp_path / "logs" / "server.log"),
    }
    doc.update(kw)
    return EngineLaunch.model_validate(doc)


def _until(what: Callable[[], object], timeout_s: float, why: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.02)


def _started(server: EngineServer) -> tuple[int, int]:
    """(API server pid, engine core pid) once both run and the core said it is up."""
    assert server.pgid is not None and server.pid is not None
    _until(lambda: "engine core up" in server.log_text(), 30, server.log_text())
    [core] = [pid for pid in group_members(server.pgid) if pid != server.pid]
    return server.pid, core


# --------------------------------------------------------------------------- stop()


@pytest.mark.parametrize("which", ["api server", "engine core"])
def test_stop_kills_an_engine_stopped_while_it_drains(tmp_path: Path, which: str) -> None:
    """The engine drains for a minute after SIGTERM; SIGSTOP one of its processes once it
    drains: stop() SIGKILLs the group at once instead of waiting out its 30 s grace."""
    server = EngineServer(_launch(tmp_path, _engine(tmp_path, drain_s=60.0)))
    server.start()
    try:
        api, core = _started(server)
        target = api if which == "api server" else core
        stopped_at: list[float] = []
        # stop() sends SIGTERM then SIGCONT: a SIGSTOP that lands between the two (the
        # engine can say it drains before the SIGCONT leaves on a loaded machine) is undone
        # by it, and the engine then drains as a healthy one would. Stop it after the SIGCONT.
        continued = threading.Event()
        send = server._signal_group

        def signal_group(pgid: int, sig: signal.Signals) -> None:
            send(pgid, sig)
            if sig == signal.SIGCONT:
                continued.set()

        server._signal_group = signal_group  # type: ignore[method-assign]

        def stop_it_while_it_drains() -> None:
            _until(lambda: f"{which} draining" in server.log_text(), 30, server.log_text())
            assert continued.wait(30), "stop() never sent SIGCONT"
            os.kill(target, signal.SIGSTOP)
            # from the signal: stop() may see the stop (and SIGKILL the group) before
            # this thread polls, so the target is stopped, a zombie or gone by then
            stopped_at.append(time.monotonic())
            _until(
                lambda: process_stopped(target) or not process_alive(target),
                5,
                f"{target} never stopped",
            )

        faulter = threading.Thread(target=stop_it_while_it_drains, daemon=True)
        faulter.start()
        t0 = time.monotonic()
        code = server.stop()  # the default 30 s grace
        took = time.monotonic() - t0
        faulter.join(timeout=5)
    finally:
        server.stop()
    assert stopped_at, "the engine was never stopped while it drained"
    assert code == -signal.SIGKILL
    assert group_members(api) == []
    # seen within a poll (0.1 s) of the stop; slack for a loaded 2-core machine
    assert time.monotonic() - stopped_at[0] < 3.0
    assert took < 10.0


def test_stop_gives_a_healthy_engine_its_whole_drain(tmp_path: Path) -> None:
    drain_s = 1.5
    server = EngineServer(_launch(tmp_path, _engine(tmp_path, drain_s=drain_s)))
    server.start()
    try:
        api, _ = _started(server)
        t0 = time.monotonic()
        code = server.stop(timeout_s=30.0)
        took = time.monotonic() - t0
    finally:
        server.stop()
    assert code == 0  # it drained and exited by itself
    assert took >= drain_s
    assert "api server draining" in server.log_text()
    assert group_members(api) == []


# --------------------------------------------------------------------------- start-up


@pytest.mark.parametrize("which", ["api server", "engine core"])
def test_a_start_whose_engine_stays_stopped_fails_within_the_bound(
    tmp_path: Path, which: str
) -> None:
    server = EngineServer(_launch(tmp_path, _engine(tmp_path, drain_s=0.0)))
    server.start()
    try:
        api, core = _started(server)
        target = api if which == "api server" else core
        os.kill(target, signal.SIGSTOP)
        _until(lambda: process_stopped(target), 5, f"{target} never stopped")
        t0 = time.monotonic()
        with pytest.raises(EngineStartError) as info:
            server.wait_healthy(timeout_s=120, stopped_after_s=1.0)
        took = time.monotonic() - t0
    finally:
        server.stop()
    message = info.value.message
    assert f"(pid {target}" in message
    assert ("API server" in message) is (which == "api server")
    assert "stopped (state T" in message and "while it started" in message
    # the engine's warnings, never an access line nor an INFO record
    assert info.value.log_lines == [WARNING]
    assert "HTTP/1.1" not in str(info.value) and "loading the model" not in str(info.value)
    # the bound, the wait's 0.5 s poll, and slack for a loaded 2-core machine
    assert 1.0 <= took < 1.0 + 0.5 + 3.0
    assert group_members(api) == []


def test_a_stop_that_ends_before_the_bound_does_not_fail_the_start(tmp_path: Path) -> None:
    """A process stopped for a moment (then continued) while the engine starts: the
    start goes on, and here ends at its timeout, never as a stopped engine."""
    server = EngineServer(_launch(tmp_path, _engine(tmp_path, drain_s=0.0)))
    server.start()
    try:
        api, _ = _started(server)
        seen = threading.Event()
        real = server.stopped_processes

        def stopped_processes() -> list[str]:
            found = real()
            if found:
                seen.set()
            return found

        server.stopped_processes = stopped_processes  # type: ignore[method-assign]

        def stop_then_continue() -> None:
            os.kill(api, signal.SIGSTOP)
            seen.wait(10)  # the wait saw it stopped; the stop ends well before the bound
            os.kill(api, signal.SIGCONT)

        faulter = threading.Thread(target=stop_then_continue, daemon=True)
        faulter.start()
        with pytest.raises(EngineStartError) as info:
            server.wait_healthy(timeout_s=6.0, stopped_after_s=3.0)
        faulter.join(timeout=5)
    finally:
        server.stop()
    assert seen.is_set(), "the start-up wait never saw the engine stopped"
    assert "not healthy after 6 s" in info.value.message


# --------------------------------------------------------------------------- runs

STUB_ENGINE = """\
#!{python}
# TEST DOUBLE for the engine venv's python: the project's stub server on the launcher's
# --port, after LOADING_S seconds of "loading" (a pid file and log lines first)
import os, sys, time
sys.path.insert(0, {repo!r})
argv = sys.argv[1:]
with open({pidfile!r}, "w") as fh:
    fh.write(str(os.getpid()))
print({warning!r}, flush=True)
print({access!r}, flush=True)
print({loading!r}, flush=True)
time.sleep({loading_s!r})
from jobs.stub.stubserver import main
main([
    "--host", "127.0.0.1", "--port", argv[argv.index("--port") + 1],
    "--model", argv[argv.index("--served-model-name") + 1], "--ttft-ms", "5", "--itl-ms", "5",
])
"""


def _stub_engine(tmp_path: Path, loading_s: float) -> str:
    path = tmp_path / "stub_engine"
    path.write_text(
        STUB_ENGINE.format(
            python=sys.executable,
            repo=str(REPO),
            pidfile=str(tmp_path / "engine.pid"),
            warning=WARNING,
            access=ACCESS,
            loading=LOADING,
            loading_s=loading_s,
        )
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _batch(tmp_path: Path, model_dir: Path, engine: str, **workload: object) -> BatchJob:
    doc: dict[str, object] = {
        "num_requests": 8,
        "prefix_tokens": 32,
        "question_tokens": 8,
        "output_tokens": 4,
        "warmup_requests": 1,
    }
    doc.update(workload)
    return BatchJob(
        launch=EngineLaunch(
            engine_python=engine,
            model_dir=str(model_dir),
            served_model_name="tiny",
            startup_timeout_s=60,
            log_path=str(tmp_path / "server.log"),
        ),
        segments=[RunSegment(run_id="r0", workload=WorkloadSpec.model_validate(doc))],
        scrape_interval_s=0.2,
        request_timeout_s=60,
    )


def test_a_run_whose_engine_is_stopped_while_it_starts_fails_within_the_hang_bound(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not at the start-up timeout (60 s here, minutes for real vLLM)."""
    hang_after_s = 1.0
    monkeypatch.setattr(enginewatch, "HANG_AFTER_S", hang_after_s)
    job = _batch(tmp_path, tiny_model_dir, _stub_engine(tmp_path, loading_s=120.0))
    pidfile = tmp_path / "engine.pid"
    stopped: dict[str, float] = {}

    def stop_it_while_it_loads() -> None:
        _until(lambda: LOADING in _text(tmp_path / "server.log"), 60, "never started")
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGSTOP)
        stopped["pid"], stopped["at"] = pid, time.monotonic()

    faulter = threading.Thread(target=stop_it_while_it_loads, daemon=True)
    faulter.start()
    [result] = execute_batch(job)
    ended = time.monotonic()
    faulter.join(timeout=5)
    assert stopped, "the engine was never stopped"
    assert result.status == "failed"
    error = result.error or ""
    assert f"API server (pid {stopped['pid']}" in error and "while it started" in error
    assert WARNING in error
    assert "HTTP/1.1" not in error and "loading the model" not in error
    # the bound, the start-up wait's poll, the stop's grace for a stopped engine, slack
    assert ended - stopped["at"] < hang_after_s + 0.5 + DEAD_ENGINE_GRACE_S + 4.0
    assert group_members(result.engine_info["pgid"]) == []


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
