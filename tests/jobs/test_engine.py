"""Tests of :mod:`jobs.engine.server`: command rendering, process-group handling, real vLLM.

The process tests use a *fake engine python*: a small script written by the
test (a test double standing in for the engine venv's interpreter) that
ignores the launcher path and either crashes with a traceback, never becomes
healthy, or ignores SIGTERM. Tests marked ``engine`` need the real vLLM CPU
environment: set ``VLAB_ENGINE__PYTHON`` to its python (or have ``./.engine-venv``).
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from jobs.engine.command import LAUNCHER_PATH, build_serve_command, engine_env, render_engine_args
from jobs.engine.processes import group_members
from jobs.engine.queries import list_engine_args
from jobs.engine.server import (
    DEAD_ENGINE_GRACE_S,
    EngineCancelledError,
    EngineDiedError,
    EngineError,
    EngineServer,
    EngineStartError,
)
from jobs.schemas import EngineLaunch
from jobs.signals.enginelog import error_lines
from tests.conftest import ENGINE_PYTHON, needs_engine


def _launch(tmp_path: Path, engine_python: str, **kw: object) -> EngineLaunch:
    data: dict[str, object] = {
        "engine_python": engine_python,
        "model_dir": str(tmp_path / "model"),
        "served_model_name": "m",
        "log_path": str(tmp_path / "logs" / "server.log"),
    }
    data.update(kw)
    return EngineLaunch.model_validate(data)


# --------------------------------------------------------------------------- command


def test_build_serve_command_layout(tmp_path: Path) -> None:
    launch = _launch(tmp_path, "/venv/bin/python", port=8125, host="0.0.0.0")
    cmd = build_serve_command(launch)
    assert cmd == [
        "/venv/bin/python",
        str(LAUNCHER_PATH),
        "serve",
        str(tmp_path / "model"),
        "--served-model-name",
        "m",
        "--host",
        "0.0.0.0",
        "--port",
        "8125",
    ]
    assert build_serve_command(launch, port=9000)[-1] == "9000"


def test_render_bool_flags_and_kebab_case() -> None:
    args = render_engine_args(
        {
            "enable_prefix_caching": False,
            "enforce_eager": True,
            "max_model_len": 2048,
            "gpu_memory_utilization": 0.5,
            "load_format": "dummy",
            "block_size": None,
        }
    )
    assert args == [
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--gpu-memory-utilization",
        "0.5",
        "--load-format",
        "dummy",
    ]
    assert render_engine_args({"enable_prefix_caching": True}) == ["--enable-prefix-caching"]


def test_render_lists_dicts_and_reserved() -> None:
    assert render_engine_args({"cudagraph_capture_sizes": [1, 2, 4]}) == [
        "--cudagraph-capture-sizes",
        "1",
        "2",
        "4",
    ]
    assert render_engine_args({"allowed_media_domains": []}) == []
    assert render_engine_args({"compilation_config": {"mode": 0}}) == [
        "--compilation-config",
        '{"mode":0}',
    ]
    # dashes in keys are accepted and normalised
    assert render_engine_args({"max-num-seqs": 4}) == ["--max-num-seqs", "4"]
    for reserved in ("model", "port", "host", "served_model_name"):
        with pytest.raises(ValueError):
            render_engine_args({reserved: "x"})
    with pytest.raises(ValueError):
        render_engine_args({"bad name": 1})


def test_engine_env(tmp_path: Path) -> None:
    launch = _launch(tmp_path, "/engine/bin/python", env={"VLLM_CPU_KVCACHE_SPACE": "2", "X": "1"})
    base = {
        "VIRTUAL_ENV": "/ours",
        "PYTHONPATH": "/src",
        "PATH": "/ours/bin:/usr/bin",
        "HOME": "/root",
    }
    env = engine_env(launch, base)
    assert "VIRTUAL_ENV" not in env and "PYTHONPATH" not in env
    assert env["PATH"] == "/engine/bin:/usr/bin"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["X"] == "1" and env["HOME"] == "/root"
    assert engine_env(_launch(tmp_path, "/e/bin/python"), {})["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_error_lines_keeps_tracebacks() -> None:
    log = "\n".join(
        [
            "INFO starting",
            "INFO loading 10%\rINFO loading 100%",
            "(EngineCore pid=7) Traceback (most recent call last):",
            '(EngineCore pid=7)   File "x.py", line 1, in <module>',
            "(EngineCore pid=7)     boom()",
            "(EngineCore pid=7) RuntimeError: Not enough memory",
            "INFO shutting down",
        ]
    )
    lines = error_lines(log)
    assert lines[0].endswith("Traceback (most recent call last):")
    assert lines[-1].endswith("RuntimeError: Not enough memory")
    assert "INFO shutting down" not in lines
    assert error_lines("a\n\nb") == ["a", "b"]  # no error lines -> plain tail


# --------------------------------------------------------------------------- fake engine

FAKE_ENGINE_PYTHON = """\
#!{python}
# Test double for the engine venv's python: ignores the launcher path and
# behaves as MODE says. Spawns a child so the process group has 2 members.
import os, signal, subprocess, sys, time
mode = {mode!r}
child = subprocess.Popen([{python!r}, "-c", "import time, signal; {child_code}"])
print("INFO fake engine starting", flush=True)
if mode == "crash":
    time.sleep(0.5)
    print("Traceback (most recent call last):", flush=True)
    print('  File "fake.py", line 1, in <module>', flush=True)
    print("RuntimeError: fake engine could not allocate the KV cache", flush=True)
    child.kill()
    sys.exit(3)
if mode == "ignore_term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while True:
    time.sleep(0.2)
"""


def _fake_engine(tmp_path: Path, mode: str) -> str:
    child_code = (
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        if mode == "ignore_term"
        else "time.sleep(600)"
    )
    path = tmp_path / f"fake_engine_python_{mode}"
    path.write_text(
        FAKE_ENGINE_PYTHON.format(python=sys.executable, mode=mode, child_code=child_code)
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _wait_members(pgid: int, n: int, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        members = group_members(pgid)
        if len(members) >= n:
            return members
        time.sleep(0.05)
    return group_members(pgid)


def test_engine_start_error_carries_error_lines(tmp_path: Path) -> None:
    server = EngineServer(_launch(tmp_path, _fake_engine(tmp_path, "crash"), port=0))
    server.start()
    try:
        assert server.port > 0
        with pytest.raises(EngineStartError) as info:
            server.wait_healthy(timeout_s=30)
        assert "exited with code 3" in str(info.value)
        assert any("fake engine could not allocate" in ln for ln in info.value.log_lines)
        assert any("Traceback" in ln for ln in info.value.log_lines)
    finally:
        server.stop(timeout_s=5)
    assert server.pgid is not None and group_members(server.pgid) == []
    # the log starts with the command line
    assert server.log_tail(100)[0].startswith("# vlab: ")


def test_engine_never_healthy_times_out_and_group_is_gone(tmp_path: Path) -> None:
    with EngineServer(_launch(tmp_path, _fake_engine(tmp_path, "hang"), port=0)) as server:
        assert server.pgid is not None
        assert len(_wait_members(server.pgid, 2)) >= 2
        t = time.monotonic()
        with pytest.raises(EngineStartError) as info:
            server.wait_healthy(timeout_s=1.5)
        assert 1.0 < time.monotonic() - t < 10
        assert "not healthy after" in str(info.value)
        assert any("fake engine starting" in ln for ln in info.value.log_lines)
    assert group_members(server.pgid) == []
    assert server.stop() is not None  # idempotent


def test_wait_healthy_cancel(tmp_path: Path) -> None:
    cancel = threading.Event()
    with EngineServer(_launch(tmp_path, _fake_engine(tmp_path, "hang"), port=0)) as server:
        threading.Timer(0.5, cancel.set).start()
        with pytest.raises(EngineCancelledError):
            server.wait_healthy(cancel, timeout_s=60)
    assert server.pgid is not None and group_members(server.pgid) == []


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    server = EngineServer(_launch(tmp_path, _fake_engine(tmp_path, "ignore_term"), port=0))
    server.start()
    assert server.pgid is not None
    members = _wait_members(server.pgid, 2)
    assert len(members) >= 2
    time.sleep(0.5)  # let the fake install its SIGTERM handler
    t = time.monotonic()
    rc = server.stop(timeout_s=1.0)
    elapsed = time.monotonic() - t
    assert rc == -9  # killed by SIGKILL
    assert 0.9 < elapsed < 15
    assert group_members(server.pgid) == []
    assert not server.is_running()


def test_list_engine_args_failure_is_engine_error(tmp_path: Path) -> None:
    with pytest.raises(EngineError) as info:
        list_engine_args(_fake_engine(tmp_path, "crash"), timeout_s=30)
    assert "exited with code 3" in str(info.value)
    with pytest.raises(EngineError):
        list_engine_args(str(tmp_path / "no-such-python"))


# --------------------------------------------------------------------------- real vLLM


@pytest.mark.engine
@needs_engine
def test_list_engine_args_real() -> None:
    assert ENGINE_PYTHON is not None
    data = list_engine_args(ENGINE_PYTHON)
    assert "cpu" in data["vllm_version"] or data["vllm_version"][0].isdigit()
    by_dest = {a["dest"]: a for a in data["args"]}
    apc = by_dest["enable_prefix_caching"]
    assert apc["is_bool_flag"] and "--no-enable-prefix-caching" in apc["options"]
    assert by_dest["max_model_len"]["options"] == ["--max-model-len"]
    assert by_dest["headless"]["is_bool_flag"]
    assert "nnodes" in by_dest and "node_rank" in by_dest
    assert len(data["args"]) > 100


def test_error_lines_keep_the_indented_message_after_the_exception_line() -> None:
    log = "\n".join(
        [
            "INFO 11-29 starting",
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in <module>',
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
            "  Value error, User-specified max_model_len (1000000) is greater than the derived",
            "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
            "INFO shutting down",
        ]
    )
    lines = error_lines(log)
    assert any("User-specified max_model_len" in ln for ln in lines)
    assert "INFO shutting down" not in lines


def test_error_lines_keep_a_pydantic_field_error_whose_name_line_is_not_indented() -> None:
    log = "\n".join(
        [
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in <module>',
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
            "max_model_len",
            "  Input should be greater than or equal to -1 [type=greater_than_equal]",
            "INFO 11-29 10:00:00 shutting down",
        ]
    )
    lines = error_lines(log)
    assert "max_model_len" in lines
    assert any("greater than or equal to -1" in ln for ln in lines)
    assert not any("shutting down" in ln for ln in lines)


def test_error_lines_put_the_first_error_first_when_it_scrolled_out() -> None:
    root = [
        "(EngineCore pid=7) Traceback (most recent call last):",
        '(EngineCore pid=7)   File "loader.py", line 3, in load',
        "(EngineCore pid=7) RuntimeError: Cannot find any model weights with `/m/tiny`",
    ]
    wrapper = []
    for i in range(80):
        wrapper.append(f'  File "api_server.py", line {i}, in run')
    log = "\n".join(
        [
            *root,
            "Traceback (most recent call last):",
            *wrapper,
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    lines = error_lines(log, n=20)
    assert lines[0] == "--- first error in the log ---"
    assert any("Cannot find any model weights" in ln for ln in lines[:3])
    assert lines[-1].endswith("See root cause above.")


def test_error_lines_leave_out_warnings_that_only_mention_an_error() -> None:
    """vLLM's start-up ulimit warning is no engine error; a warning that a process died is."""
    log = "\n".join(
        [
            "(APIServer pid=1) WARNING 12-01 16:04:40 [system_utils.py:255] Found ulimit of "
            "1024 and failed to automatically increase with error current limit exceeds "
            "maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too many "
            "open files`. Consider increasing with ulimit -n",
            "(APIServer pid=1) INFO 12-01 16:04:41 [launcher.py:1] Route: /v1/chat/completions",
            "(APIServer pid=1) WARNING 12-01 16:04:44 [core_client.py:817] [shutdown] MPClient: "
            "engine core exited unexpectedly; starting cleanup",
            "(APIServer pid=1) ERROR 12-01 16:04:44 [async_llm.py:906] vllm.v1.engine.exceptions"
            ".EngineDeadError: EngineCore encountered an issue.",
        ]
    )
    lines = error_lines(log)
    assert not any("ulimit" in ln for ln in lines)
    assert any("exited unexpectedly" in ln for ln in lines)
    assert lines[-1].endswith("EngineCore encountered an issue.")


def test_death_names_the_process_of_the_group_that_went(tmp_path: Path) -> None:
    """Once watched, a child of the group that exits is the engine's death (the API
    server, the group's leader, still runs), and ``stop`` does not wait long for it."""
    server = EngineServer(_launch(tmp_path, _fake_engine(tmp_path, "hang"), port=0))
    server.start()
    try:
        assert server.pgid is not None
        members = _wait_members(server.pgid, 2)
        watched = server.watch_members()
        assert set(watched) == set(members)
        assert server.death() is None
        server.check_alive()
        child = next(pid for pid in members if pid != server.pid)
        os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while server.death() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        reason = server.death()
        assert reason is not None and f"(pid {child})" in reason and "is gone" in reason
        with pytest.raises(EngineDiedError) as info:
            server.check_alive()
        # nothing was logged since the watch began: no unrelated start-up line is quoted
        assert info.value.log_lines == []
        t = time.monotonic()
        server.stop()
        assert time.monotonic() - t < DEAD_ENGINE_GRACE_S + 5
    finally:
        server.stop(timeout_s=5)
    assert group_members(server.pgid) == []


# --------------------------------------------------------------------------- port race

STUB_ENGINE_PYTHON = """#!{python}
# fake engine python: serves the stub server on the --port of the launcher's command line
import sys
sys.path.insert(0, {repo!r})
argv = sys.argv[1:]
port = argv[argv.index("--port") + 1]
from jobs.stub.stubserver import main
main(["--host", "127.0.0.1", "--port", port, "--ttft-ms", "1", "--itl-ms", "1"])
"""


def _stub_engine(tmp_path: Path) -> str:
    path = tmp_path / "stub_engine_python"
    repo = str(Path(__file__).resolve().parents[2])
    path.write_text(STUB_ENGINE_PYTHON.format(python=sys.executable, repo=repo))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_picked_port_taken_before_the_engine_binds_it_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """find_free_port can only say a port *was* free; another process (a Ray worker's gRPC
    server, seen in CI with the simulated Ray executor) may bind it before the engine
    does. The engine exits with "[Errno 98] Address already in use": start again on a
    new port instead of failing the run."""
    import socket

    import jobs.engine.server as engine_mod

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    taken = squatter.getsockname()[1]
    real_pick = engine_mod.find_free_port
    picks = iter([taken])
    monkeypatch.setattr(
        engine_mod, "find_free_port", lambda host: next(picks, None) or real_pick(host)
    )
    try:
        with EngineServer(_launch(tmp_path, _stub_engine(tmp_path), port=0)) as server:
            assert server.port == taken
            server.wait_healthy(timeout_s=60)
            assert server.port != taken and server.port_retries == 1
            assert server.command[server.command.index("--port") + 1] == str(server.port)
            assert server.info() == {
                "command": server.command,
                "port": server.port,
                "pgid": server.pgid,
                "port_retries": 1,
            }
            log = server.log_text()
            # both attempts are in the log, the first one's error above the note
            assert "Address already in use" in log
            assert f"port {taken} was taken before the engine bound it" in log
            assert log.index("Address already in use") < log.index("was taken before")
    finally:
        squatter.close()


def test_a_port_the_user_gave_is_not_retried(tmp_path: Path) -> None:
    import socket

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    taken = squatter.getsockname()[1]
    try:
        with EngineServer(_launch(tmp_path, _stub_engine(tmp_path), port=taken)) as server:
            with pytest.raises(EngineStartError) as info:
                server.wait_healthy(timeout_s=60)
            assert server.port_retries == 0
            assert any("Address already in use" in ln for ln in info.value.log_lines)
    finally:
        squatter.close()
