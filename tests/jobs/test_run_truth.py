"""Run truth, without vLLM: a run whose engine dies, whose port closes, or that loses too
many requests is never ``succeeded``; the load stops at the first sign of a dead server;
progress stays truthful; every record is handed out as soon as its request finished.

The engine is a test double (a fake engine python written by the test): a tiny
OpenAI-compatible server in the standard library with a child process titled
``VLLM::EngineCore`` (``exec -a``), as vLLM's API server has, that can answer
every Nth request with HTTP 500 or stop listening while it stays alive.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

from jobs.engine.processes import group_members
from jobs.engine.server import EngineServer
from jobs.run.runner import execute_batch
from jobs.schemas import (
    BatchJob,
    EngineLaunch,
    Progress,
    RequestRecord,
    RunResult,
    RunSegment,
    WorkloadSpec,
)

FAKE_ENGINE = """\
#!{python}
# Test double for the engine venv's python: an OpenAI-compatible server with a child
# titled like vLLM's engine core.
import json, os, subprocess, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv
port = int(argv[argv.index("--port") + 1])
fail_every = {fail_every!r}  # every Nth chat request answers HTTP 500
close_after = {close_after!r}  # after N chat requests the port closes; the process lives on
core = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 600"])
print("INFO fake engine starting", flush=True)
print("WARNING Found ulimit of 1024 and failed to automatically increase with error x",
      flush=True)
state = {{"chats": 0}}
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, code, body, ctype="application/json"):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._send(200, "")
        elif self.path == "/metrics":
            self._send(200, "vllm:num_requests_running 0\\n", "text/plain")
        else:
            self._send(404, "{{}}")

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)) or 0)
        if self.path == "/reset_prefix_cache":
            self._send(200, json.dumps({{"success": True}}))
            return
        req = json.loads(body)
        with lock:
            state["chats"] += 1
            n = state["chats"]
        if close_after is not None and n == close_after + 1:
            print("ERROR fake engine: the API server stops listening", flush=True)
            threading.Thread(target=httpd.shutdown).start()
        if fail_every and n % fail_every == 0:
            self._send(500, json.dumps({{"error": {{"message": "boom"}}}}))
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(req["max_tokens"]):
            chunk = {{"choices": [{{"delta": {{"content": "x"}}}}]}}
            self.wfile.write(f"data: {{json.dumps(chunk)}}\\n\\n".encode())
            self.wfile.flush()
            time.sleep(0.01)
        usage = {{"choices": [], "usage": {{"prompt_tokens": 100,
                  "completion_tokens": req["max_tokens"]}}}}
        self.wfile.write(f"data: {{json.dumps(usage)}}\\n\\ndata: [DONE]\\n\\n".encode())
        self.wfile.flush()
        self.close_connection = True


httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
httpd.serve_forever()
httpd.server_close()  # nothing listens on the port any more
while True:
    time.sleep(1)
"""


def _fake_engine(
    tmp_path: Path, fail_every: int | None = None, close_after: int | None = None
) -> str:
    path = tmp_path / f"fake_engine_{fail_every}_{close_after}"
    path.write_text(
        FAKE_ENGINE.format(python=sys.executable, fail_every=fail_every, close_after=close_after)
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _job(
    tmp_path: Path, model_dir: Path, engine: str, n: int, concurrency: int = 4, **kw: float
) -> BatchJob:
    workload = WorkloadSpec.model_validate(
        {
            "num_requests": n,
            "concurrency": concurrency,
            "prefix_tokens": 64,
            "output_tokens": 8,
            "warmup_requests": 1,
        }
    )
    return BatchJob(
        launch=EngineLaunch(
            engine_python=engine,
            model_dir=str(model_dir),
            served_model_name="tiny",
            startup_timeout_s=60,
            log_path=str(tmp_path / "server.log"),
        ),
        segments=[RunSegment(run_id="r0", workload=workload)],
        scrape_interval_s=0.2,
        request_timeout_s=30,
        **kw,
    )


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _no_engine_left(result: RunResult) -> None:
    pgid = result.engine_info.get("pgid")
    assert pgid is not None and group_members(pgid) == []


def _progress_is_truthful(progress: list[Progress], planned: int) -> None:
    for p in progress:
        if p.phase not in ("warmup",):
            assert p.requests_done <= p.requests_total, p
            assert p.requests_total == planned, p
    assert progress[-1].phase == "done"


def test_engine_core_killed_mid_run_fails_partial_and_stops_the_load(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server keeps answering when its engine core dies: the process watch ends the run.

    Before: the run ended ``succeeded`` after all 2000 requests (the API server lived on).
    """
    import jobs.run.runner as runner

    servers: list[EngineServer] = []

    class Recorded(EngineServer):
        def start(self) -> None:
            super().start()
            servers.append(self)

    monkeypatch.setattr(runner, "EngineServer", Recorded)
    progress: list[Progress] = []
    streamed: list[tuple[str, RequestRecord, float]] = []
    killed_at: list[float] = []

    def on_progress(p: Progress) -> None:
        progress.append(p)
        if p.phase == "measuring" and p.requests_done == 20 and not killed_at:
            pgid = servers[0].pgid
            assert pgid is not None
            core = next(m for m in group_members(pgid) if "VLLM::EngineCore" in _title(m))
            os.kill(core, signal.SIGKILL)
            killed_at.append(time.monotonic())

    def on_record(run_id: str, record: RequestRecord) -> None:
        streamed.append((run_id, record, time.monotonic()))

    job = _job(tmp_path, tiny_model_dir, _fake_engine(tmp_path), n=2000)
    [result] = execute_batch(job, progress=on_progress, on_record=on_record)
    ended = time.monotonic()
    assert result.status == "failed" and result.partial
    assert "VLLM::EngineCore" in (result.error or "") and "is gone" in (result.error or "")
    assert "ulimit" not in (result.error or "")  # a start-up warning is not the cause
    measured = [r for r in result.requests if not r.warmup]
    assert 20 <= len(measured) < 200  # the load stopped at once, not after 2000 requests
    assert result.metrics["completed"] >= 20
    # detection takes 0.1 s; the rest is the wait for the engine's own lines (3 s at most)
    assert ended - killed_at[0] < 8.0
    # every record was handed out as its request finished, before the run ended
    assert sorted((r.index, r.warmup) for _, r, _ in streamed) == sorted(
        (r.index, r.warmup) for r in result.requests
    )
    assert {rid for rid, _, _ in streamed} == {"r0"}
    assert sum(1 for _, _, t in streamed if t < killed_at[0]) >= 20
    _progress_is_truthful(progress, 2000)
    assert progress[-1].requests_done == len(measured)
    _no_engine_left(result)


def test_closed_port_stops_the_load_at_the_first_refusal(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A port that refuses connections (the process still runs): no request after it."""
    progress: list[Progress] = []
    job = _job(tmp_path, tiny_model_dir, _fake_engine(tmp_path, close_after=30), n=400)
    t0 = time.monotonic()
    [result] = execute_batch(job, progress=progress.append)
    assert time.monotonic() - t0 < 60
    assert result.status == "failed" and result.partial
    assert "refused connections" in (result.error or ""), result.error
    measured = [r for r in result.requests if not r.warmup]
    refused = [r for r in measured if (r.error or "").startswith("connection refused")]
    # before: every one of the 400 requests was sent to the dead port
    assert 1 <= len(refused) <= 4, len(refused)
    assert len(measured) < 60
    _progress_is_truthful(progress, 400)
    _no_engine_left(result)


def test_failed_share_above_the_threshold_fails_the_run(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Every 10th request fails (10 %): above the default 5 % the run fails, partial."""
    engine = _fake_engine(tmp_path, fail_every=10)
    result = execute_batch(_job(tmp_path, tiny_model_dir, engine, n=60))
    assert result[0].status == "failed" and result[0].partial
    assert result[0].metrics["failed"] == 6 and result[0].metrics["completed"] == 54
    assert "6 of 60 measured requests failed" in (result[0].error or "")
    assert "5.0%" in (result[0].error or "")
    # a looser threshold (the setting) accepts the same run
    looser = execute_batch(_job(tmp_path, tiny_model_dir, engine, n=60, max_failed_fraction=0.2))
    assert looser[0].status == "succeeded", looser[0].error
    assert not looser[0].partial
