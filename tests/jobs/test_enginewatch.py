"""A hung engine (:mod:`jobs.run.enginewatch`) is caught like a dead one.

Pure: the warning-and-error filter on a real vLLM 0.32 CPU log (never an access line
nor an ``INFO`` record). Against loopback servers: :class:`HangWatch` calls a server
that accepts connections and answers nothing hung within its bound, and a server that
answers no probe but still streams bytes alive. End to end with the project's stub
server as the engine (test double, launched the way runs launch vLLM, and logging
vLLM's access and stats lines): its API server SIGSTOPped mid-measure fails the run
``partial`` within the bound, the error names the stopped process and quotes no access
line, and no process of the engine is left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from jobs.engine.processes import group_members
from jobs.engine.server import DEAD_ENGINE_GRACE_S, EngineServer
from jobs.load import sseclient
from jobs.run import enginewatch
from jobs.run.drive import ENGINE_WATCH_INTERVAL_S
from jobs.run.runner import execute_batch
from jobs.schemas import BatchJob, EngineLaunch, Progress, RunSegment, WorkloadSpec
from jobs.signals.errorlines import error_lines, warning_and_error_lines

REPO = Path(__file__).resolve().parents[2]
#: a real vLLM 0.32 CPU engine log (tests/jobs/data/enginelog/README.md)
VLLM_LOG = Path(__file__).resolve().parent / "data" / "enginelog" / "vllm032_cpu_startup.log"
ACCESS = '(APIServer pid=123) INFO:     127.0.0.1:45678 - "POST /v1/completions HTTP/1.1" 200 OK'
STATS = (
    "(APIServer pid=123) INFO 12-05 10:00:00 [loggers.py:123] Engine 000: Avg prompt "
    "throughput: 10.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 1 reqs"
)


# --------------------------------------------------------------------------- log lines


def test_warnings_and_errors_of_a_real_vllm_log_never_access_lines() -> None:
    text = VLLM_LOG.read_text()
    assert text.count("HTTP/1.1") > 40  # the log is full of access lines
    lines = warning_and_error_lines(text)
    assert lines, "the log's WARNING records are kept"
    assert all(" WARNING " in ln for ln in lines)
    assert any("force killing remaining process EngineCore" in ln for ln in lines)
    assert not any("HTTP/1.1" in ln or " INFO " in ln for ln in lines)
    # the part after the server became healthy (its first access line) holds only the two
    # shutdown warnings: the rest is access and INFO lines
    after = text[text.index("INFO:     127.0.0.1") :]
    assert [ln.split("] ", 1)[1] for ln in warning_and_error_lines(after)] == [
        "[shutdown] Process manager: force killing remaining processes count=1",
        "[shutdown] Process manager: force killing remaining process EngineCore pid 13803",
    ]


def test_no_warning_gives_nothing_and_the_fallback_skips_access_lines() -> None:
    text = "\n".join(
        [ACCESS, STATS, ACCESS, 'INFO:     127.0.0.1:1 - "GET /metrics HTTP/1.1" 200 OK']
    )
    assert warning_and_error_lines(text) == []
    # error_lines falls back to the last lines when none is an error: never access lines
    assert error_lines(text) == [STATS]
    failing = ACCESS.replace("200 OK", "500 Internal Server Error")
    assert error_lines(f"{failing}\nERROR 12-05 10:00:01 [core.py:1] boom") == [
        "ERROR 12-05 10:00:01 [core.py:1] boom"
    ]


# --------------------------------------------------------------------------- HangWatch


def _silent_server() -> socket.socket:
    """Accepts connections (the kernel does, as for a stopped process) and answers nothing."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def test_a_server_that_answers_nothing_is_hung_within_the_bound() -> None:
    sock = _silent_server()
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def watch() -> tuple[float, str]:
        hang = enginewatch.HangWatch(base_url, after_s=0.9)
        prober = asyncio.create_task(hang.probe())
        t0 = time.perf_counter()
        try:
            while (verdict := hang.verdict()) is None:
                assert time.perf_counter() - t0 < 10, "no verdict"
                await asyncio.sleep(0.05)
        finally:
            prober.cancel()
        return time.perf_counter() - t0, verdict

    try:
        took, verdict = asyncio.run(watch())
    finally:
        sock.close()
    assert "no answer to /health" in verdict and "no byte on any request stream" in verdict
    # the bound: after_s since the last sign of life (the start), plus a probe's slack
    assert 0.9 <= took < 0.9 + 0.9 / 3 + 1.0


def test_bytes_on_a_stream_say_a_server_is_alive() -> None:
    """A server too busy to answer /health that still streams: never judged hung."""
    sock = _silent_server()
    port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    stop = threading.Event()

    def stream() -> None:  # a response that sends a line every 0.1 s
        conn, _ = sock.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        while not stop.wait(0.1):
            conn.sendall(b"data: {}\n\n")
        conn.close()

    async def watch() -> str | None:
        hang = enginewatch.HangWatch(base_url, after_s=0.6)
        prober = asyncio.create_task(hang.probe())
        pool = sseclient.ConnectionPool(base_url)
        request = asyncio.create_task(pool.post("/v1/completions", b"{}", lambda *_: None))
        verdict = None
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 2.5 and verdict is None:
            verdict = hang.verdict()
            await asyncio.sleep(0.05)
        stop.set()
        prober.cancel()
        request.cancel()
        pool.close()
        return verdict

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    try:
        assert asyncio.run(watch()) is None
    finally:
        stop.set()
        sock.close()


def test_a_stopped_process_behind_an_answering_api_server_is_hung() -> None:
    """A stopped engine core leaves /health answering and every stream standing still:
    the process's state T for the bound is the verdict."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{server.server_address[1]}"
    stopped = ["VLLM::EngineCore (pid 7)"]

    async def watch() -> tuple[float, str]:
        hang = enginewatch.HangWatch(base_url, after_s=0.5, stopped=lambda: stopped)
        prober = asyncio.create_task(hang.probe())
        t0 = time.perf_counter()
        try:
            while (verdict := hang.verdict()) is None:
                assert time.perf_counter() - t0 < 10, "no verdict"
                await asyncio.sleep(0.05)
        finally:
            prober.cancel()
        return time.perf_counter() - t0, verdict

    try:
        took, verdict = asyncio.run(watch())
    finally:
        server.shutdown()
        server.server_close()
    assert verdict.startswith("VLLM::EngineCore (pid 7) of the vLLM engine has been stopped")
    # seen at the first probe, judged at the first probe after the bound (1 s apart)
    assert 0.5 <= took < 0.5 + enginewatch.PROBE_INTERVAL_S + 1.0


def test_stop_ends_a_stopped_engine_at_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    """SIGTERM does not act on a stopped process: stop() continues the group and gives a
    stopped engine the short grace, not the 30 s one."""
    launch = EngineLaunch(
        engine_python=_stub_engine(tmp_path),
        model_dir=str(tiny_model_dir),
        served_model_name="tiny",
        log_path=str(tmp_path / "server.log"),
    )
    server = EngineServer(launch)
    server.start()
    try:
        server.wait_healthy(timeout_s=60)
        assert server.pgid is not None
        os.killpg(server.pgid, signal.SIGSTOP)
        deadline = time.monotonic() + 5  # the signal is taken when the process next runs
        while not server.stopped_processes():
            assert time.monotonic() < deadline, server.process_states()
            time.sleep(0.02)
        assert any("T (stopped)" in state for state in server.process_states())
        t0 = time.perf_counter()
        server.stop()
        took = time.perf_counter() - t0
    finally:
        server.stop()
    assert group_members(server.pgid) == []
    assert took < DEAD_ENGINE_GRACE_S + 2.0


# --------------------------------------------------------------------------- end to end

STUB_ENGINE = """#!{python}
# TEST DOUBLE for the engine venv's python: the project's stub server on the launcher's
# --port, logging vLLM's access and stats lines (what a real engine's log is full of)
import os, sys, threading, time
sys.path.insert(0, {repo!r})
argv = sys.argv[1:]
port = argv[argv.index("--port") + 1]
with open({pidfile!r}, "w") as fh:
    fh.write(str(os.getpid()))
def noise():
    while True:
        time.sleep(0.05)
        print({access!r}, flush=True)
        print({stats!r}, flush=True)
threading.Thread(target=noise, daemon=True).start()
from jobs.stub.stubserver import main
main(["--host", "127.0.0.1", "--port", port, "--ttft-ms", "5", "--itl-ms", "20"])
"""


def _stub_engine(tmp_path: Path) -> str:
    path = tmp_path / "stub_engine"
    path.write_text(
        STUB_ENGINE.format(
            python=sys.executable,
            repo=str(REPO),
            pidfile=str(tmp_path / "engine.pid"),
            access=ACCESS,
            stats=STATS,
        )
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.parametrize("phase", ["measuring", "warmup"])
def test_a_sigstopped_engine_fails_the_run_within_the_bound(
    phase: str, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGSTOP of the API server after 3 measured requests (``partial``), or as the
    warm-up begins (nothing measured)."""
    hang_after_s = 2.0
    monkeypatch.setattr(enginewatch, "HANG_AFTER_S", hang_after_s)
    workload = WorkloadSpec.model_validate(
        {"num_requests": 40, "prefix_tokens": 32, "output_tokens": 20, "warmup_requests": 1}
    )
    job = BatchJob(
        launch=EngineLaunch(
            engine_python=_stub_engine(tmp_path),
            model_dir=str(tiny_model_dir),
            served_model_name="tiny",
            startup_timeout_s=60,
            log_path=str(tmp_path / "server.log"),
        ),
        segments=[RunSegment(run_id="r0", workload=workload)],
        scrape_interval_s=0.2,
        request_timeout_s=120,
    )
    stopped: dict[str, float] = {}

    def progress(p: Progress) -> None:
        wanted = 3 if phase == "measuring" else 0
        if p.phase == phase and p.requests_done >= wanted and not stopped:
            pid = int((tmp_path / "engine.pid").read_text())
            os.kill(pid, signal.SIGSTOP)
            stopped["pid"], stopped["at"] = pid, time.perf_counter()

    [result] = execute_batch(job, progress=progress)
    took = time.perf_counter() - stopped["at"]
    assert result.status == "failed", result.error
    assert result.partial is (phase == "measuring")
    # the bound: the silence (counted from the last byte, before the stop), the watcher's
    # poll, the stop's grace for a hung engine, and slack for a loaded 2-core machine
    assert took < hang_after_s + ENGINE_WATCH_INTERVAL_S + DEAD_ENGINE_GRACE_S + 3.0
    error = result.error or ""
    assert "hung during run r0" in error
    assert f"API server (pid {stopped['pid']}" in error and "T (stopped)" in error
    assert enginewatch.NO_WARNINGS in error
    assert "HTTP/1.1" not in error and "Avg prompt throughput" not in error
    measured = [r for r in result.requests if not r.warmup]
    assert sum(r.success for r in measured) >= (3 if phase == "measuring" else 0)
    assert group_members(result.engine_info["pgid"]) == []
