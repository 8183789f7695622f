"""Tests of :func:`jobs.run.runner.execute_batch`: several runs on one vLLM server.

Without vLLM: a fake engine python (test double) that serves a tiny
OpenAI-compatible HTTP API with the standard library (``/health``,
``/metrics``, ``/reset_prefix_cache``, streamed ``/v1/chat/completions``) and
can die after a given number of chat requests; it checks the batch flow,
the server dying mid-batch, cancellation, and that no process is left. With
vLLM (``needs_engine``): TP=2 with a core list per rank (segments on a reused real
server after a prefix cache reset: tests/jobs/test_runner_real_vllm.py).
"""

from __future__ import annotations

import stat
import sys
import threading
from pathlib import Path

import pytest

from jobs.engine.processes import group_members
from jobs.run.runner import execute, execute_batch
from jobs.schemas import (
    BatchJob,
    EngineLaunch,
    Progress,
    RunJob,
    RunResult,
    RunSegment,
    WorkloadSpec,
)
from tests.conftest import ENGINE_PYTHON, needs_engine

FAKE_HTTP_ENGINE = """\
#!{python}
# Test double for the engine venv's python: a tiny OpenAI-compatible server.
import json, os, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv
port = int(argv[argv.index("--port") + 1])
die_after = {die_after!r}
freeze_after = {freeze_after!r}
reset = {reset!r}  # None: resets work; "refused": 404 (no dev mode); "dying": 500, then exit
state = {{"chats": 0, "queries": 0, "hits": 0, "resets": 0}}
lock = threading.Lock()
print("INFO fake engine starting", flush=True)


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
            text = (
                "# TYPE vllm:prefix_cache_queries counter\\n"
                f"vllm:prefix_cache_queries_total {{state['queries']}}\\n"
                "# TYPE vllm:prefix_cache_hits counter\\n"
                f"vllm:prefix_cache_hits_total {{state['hits']}}\\n"
            )
            self._send(200, text, "text/plain")
        else:
            self._send(404, "{{}}")

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)) or 0)
        if self.path == "/reset_prefix_cache" and reset == "refused":
            self._send(404, json.dumps({{"detail": "Not Found"}}))
            return
        if self.path == "/reset_prefix_cache" and reset == "dying":
            # as vLLM's API server whose engine core died in the warm-up: the reset
            # fails with EngineDeadError, and the processes exit a moment later
            print("ERROR fake engine: EngineCore encountered a fatal error.", flush=True)
            self._send(500, json.dumps({{"error": "EngineDeadError"}}))
            threading.Timer(0.5, os._exit, args=(1,)).start()
            return
        if self.path == "/reset_prefix_cache":
            state["resets"] += 1
            print(f"INFO fake engine: prefix cache reset #{{state['resets']}}", flush=True)
            self._send(200, json.dumps({{"success": True}}))
            return
        if self.path != "/v1/chat/completions":
            self._send(404, "{{}}")
            return
        req = json.loads(body)
        with lock:
            state["chats"] += 1
            n = state["chats"]
            state["queries"] += 100
            state["hits"] += 50
        if die_after is not None and n > die_after:
            print("ERROR fake engine: worker process died unexpectedly", flush=True)
            os._exit(1)
        if freeze_after is not None and n > freeze_after:
            print("INFO fake engine: freezing (stops answering, stays alive)", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(req["max_tokens"]):
            chunk = {{"choices": [{{"delta": {{"content": "x"}}}}]}}
            self.wfile.write(f"data: {{json.dumps(chunk)}}\\n\\n".encode())
            self.wfile.flush()
            time.sleep(0.005)
        usage = {{"choices": [], "usage": {{"prompt_tokens": 100,
                  "completion_tokens": req["max_tokens"]}}}}
        self.wfile.write(f"data: {{json.dumps(usage)}}\\n\\ndata: [DONE]\\n\\n".encode())
        self.wfile.flush()
        self.close_connection = True


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def fake_engine_script(
    die_after: int | None = None, freeze_after: int | None = None, reset: str | None = None
) -> str:
    """The text of :data:`FAKE_HTTP_ENGINE` (a TEST DOUBLE engine python) for these modes."""
    return FAKE_HTTP_ENGINE.format(
        python=sys.executable, die_after=die_after, freeze_after=freeze_after, reset=reset
    )


def _fake_engine(
    tmp_path: Path,
    die_after: int | None,
    freeze_after: int | None = None,
    reset: str | None = None,
) -> str:
    path = tmp_path / f"fake_http_engine_{die_after}_{freeze_after}_{reset}"
    path.write_text(fake_engine_script(die_after, freeze_after, reset))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _workload(**kw: int) -> WorkloadSpec:
    spec = {"num_requests": 4, "prefix_tokens": 256, "output_tokens": 8, "warmup_requests": 1}
    spec.update(kw)
    return WorkloadSpec.model_validate(spec)


def _batch(
    tmp_path: Path,
    model_dir: Path,
    engine_python: str,
    workloads: list[WorkloadSpec],
    engine_args: dict[str, object] | None = None,
) -> BatchJob:
    return BatchJob(
        launch=EngineLaunch(
            engine_python=engine_python,
            model_dir=str(model_dir),
            served_model_name="tiny",
            engine_args=engine_args or {},
            port=0,
            startup_timeout_s=600,
            log_path=str(tmp_path / "server.log"),
        ),
        segments=[RunSegment(run_id=f"r{i}", workload=w) for i, w in enumerate(workloads)],
        scrape_interval_s=0.5,
        request_timeout_s=120,
    )


def _assert_no_engine_left(results: list[RunResult]) -> None:
    for result in results:
        pgid = result.engine_info.get("pgid")
        if pgid is not None:
            assert group_members(pgid) == []


# --------------------------------------------------------------------------- fake engine


def test_server_that_stops_answering_ends_the_run_partial(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live server that freezes mid-run (SIGSTOP): the run ends, measured data kept."""
    import jobs.run.enginewatch as enginewatch

    monkeypatch.setattr(enginewatch, "HANG_AFTER_S", 1.0)
    # 1 warm-up + 3 measured requests answered, then the server freezes
    job = _batch(
        tmp_path,
        tiny_model_dir,
        _fake_engine(tmp_path, None, freeze_after=4),
        [_workload(num_requests=8), _workload()],
    )
    job = job.model_copy(update={"scrape_interval_s": 0.2})
    results = execute_batch(job)
    first, second = results
    assert first.status == "failed" and first.partial
    assert "hung" in (first.error or "") and "T (stopped)" in (first.error or "")
    measured = [r for r in first.requests if not r.warmup]
    assert sum(r.success for r in measured) == 3
    assert first.metrics["completed"] == 3  # what was measured is summarized
    assert first.engine_info["partial"] is True
    assert second.status == "failed" and not second.partial
    _assert_no_engine_left(results)


@pytest.mark.parametrize("reset", ["refused", "dying"])
def test_a_failed_prefix_cache_reset_fails_the_run_with_its_cause(
    tmp_path: Path, tiny_model_dir: Path, reset: str
) -> None:
    """A reset refused by a live server (no dev mode) fails the run saying so; one refused
    by an engine that died in the warm-up fails it as that death, not as a dev-mode
    problem (vLLM's processes exit a moment after their engine core's fatal error)."""
    job = _batch(tmp_path, tiny_model_dir, _fake_engine(tmp_path, None, reset=reset), [_workload()])
    (result,) = execute_batch(job)
    assert result.status == "failed"
    error = result.error or ""
    if reset == "refused":
        assert "POST /reset_prefix_cache failed" in error and "VLLM_SERVER_DEV_MODE=1" in error
    else:
        assert "engine died" in error and "VLLM_SERVER_DEV_MODE" not in error, error
        assert "EngineCore encountered a fatal error" in error
    _assert_no_engine_left([result])


def test_batch_fake_engine_reuses_the_server(tmp_path: Path, tiny_model_dir: Path) -> None:
    progress: list[Progress] = []
    job = _batch(
        tmp_path,
        tiny_model_dir,
        _fake_engine(tmp_path, None),
        [_workload(), _workload(concurrency=2, num_requests=3), _workload(warmup_requests=0)],
    )
    results = execute_batch(job, progress=progress.append)
    assert [r.status for r in results] == ["succeeded"] * 3, [r.error for r in results]
    assert [r.run_id for r in results] == ["r0", "r1", "r2"]
    assert [r.engine_info["server_reused"] for r in results] == [False, True, True]
    assert [r.engine_info["cache_isolation"] for r in results] == [
        "server_restart",
        "reset_prefix_cache",
        "reset_prefix_cache",
    ]
    assert [r.engine_info["segment_index"] for r in results] == [0, 1, 2]
    assert {r.engine_info["segments_total"] for r in results} == {3}
    assert len({r.engine_info["pgid"] for r in results}) == 1
    assert all(r.engine_info["prefix_cache_reset_ok"] for r in results)
    first, second, third = results
    assert first.timings["startup_s"] > 0 and "startup_saved_s" not in first.timings
    for later in (second, third):
        assert "startup_s" not in later.timings
        assert later.timings["startup_saved_s"] == first.timings["startup_s"]
    assert "stop_s" in third.timings and "stop_s" not in first.timings
    assert [r.metrics["completed"] for r in results] == [4, 3, 4]
    # Fake counters: +100 queries / +50 hits per chat request, deltas per segment.
    assert [r.metrics["prefix_cache_queries_delta"] for r in results] == [400, 300, 400]
    # Log up to the end of each segment: one reset, two, three.
    assert "reset #1" in first.engine_log and "reset #2" not in first.engine_log
    assert "reset #2" in second.engine_log and "reset #3" not in second.engine_log
    assert "reset #3" in third.engine_log
    # Progress: every report names its run; one "done" per run, in order.
    assert all(p.run_id in {"r0", "r1", "r2"} for p in progress)
    assert [p.run_id for p in progress if p.phase == "done"] == ["r0", "r1", "r2"]
    assert [p.phase for p in progress if p.run_id == "r0"][:2] == ["starting", "waiting_health"]
    assert {p.phase for p in progress if p.run_id == "r1"} == {"warmup", "measuring", "done"}
    _assert_no_engine_left(results)


def test_batch_fake_engine_dies_mid_batch(tmp_path: Path, tiny_model_dir: Path) -> None:
    # Segment 0: 1 warm-up + 2 measured; segment 1 dies at its 2nd measured request.
    job = _batch(
        tmp_path,
        tiny_model_dir,
        _fake_engine(tmp_path, die_after=5),
        [_workload(num_requests=2), _workload(num_requests=4), _workload(num_requests=2)],
    )
    results = execute_batch(job)
    assert [r.status for r in results] == ["succeeded", "failed", "failed"]
    _, died, never = results
    assert died.error is not None and "worker process died unexpectedly" in died.error
    assert "exited with code 1" in died.error
    assert never.error is not None and "worker process died unexpectedly" in never.error
    assert never.error.startswith("not run") and "r1" in never.error
    assert died.engine_info["server_reused"] is True
    assert "worker process died" in died.engine_log
    assert [r.success for r in died.requests if not r.warmup][:1] == [True]
    assert never.requests == []
    _assert_no_engine_left(results)


def test_batch_fake_engine_cancel_mid_batch(tmp_path: Path, tiny_model_dir: Path) -> None:
    cancel = threading.Event()

    def on_progress(p: Progress) -> None:
        if p.run_id == "r1" and p.phase == "measuring":
            cancel.set()

    job = _batch(
        tmp_path,
        tiny_model_dir,
        _fake_engine(tmp_path, None),
        [_workload(num_requests=2), _workload(num_requests=50), _workload(num_requests=2)],
    )
    results = execute_batch(job, progress=on_progress, cancel=cancel)
    assert [r.status for r in results] == ["succeeded", "cancelled", "cancelled"]
    assert len([r for r in results[1].requests if not r.warmup]) < 50
    _assert_no_engine_left(results)


def test_batch_bad_segment_fails_alone(tmp_path: Path, tiny_model_dir: Path) -> None:
    bad = WorkloadSpec.model_construct(**{**_workload().model_dump(), "kind": "unknown"})
    job = _batch(
        tmp_path, tiny_model_dir, _fake_engine(tmp_path, None), [bad, _workload(num_requests=2)]
    )
    results = execute_batch(job)
    assert [r.status for r in results] == ["failed", "succeeded"]
    assert results[0].error is not None and "request list" in results[0].error
    # The first segment that ran started the server.
    assert results[1].engine_info["server_reused"] is False
    assert results[1].engine_info["cache_isolation"] == "server_restart"
    assert results[1].timings["startup_s"] > 0
    _assert_no_engine_left(results)


def test_execute_is_a_one_segment_batch(tmp_path: Path, tiny_model_dir: Path) -> None:
    phases: list[Progress] = []
    job = RunJob(
        run_id="solo",
        launch=EngineLaunch(
            engine_python=_fake_engine(tmp_path, None),
            model_dir=str(tiny_model_dir),
            served_model_name="tiny",
            log_path=str(tmp_path / "solo.log"),
        ),
        workload=_workload(num_requests=2),
        scrape_interval_s=0.5,
    )
    result = execute(job, progress=phases.append)
    assert result.status == "succeeded", result.error
    assert result.run_id == "solo"
    assert result.engine_info["server_reused"] is False
    assert result.engine_info["cache_isolation"] == "server_restart"
    assert (result.engine_info["segment_index"], result.engine_info["segments_total"]) == (0, 1)
    for key in ("startup_s", "warmup_s", "measure_s", "stop_s", "total_s"):
        assert key in result.timings
    assert result.engine_info["exit_code"] is not None
    assert {p.run_id for p in phases} == {"solo"}
    assert [p.phase for p in phases][-2:] == ["stopping", "done"]
    _assert_no_engine_left([result])


# --------------------------------------------------------------------------- real vLLM


@pytest.mark.engine
@needs_engine
def test_execute_real_tp2_with_thread_binding(tmp_path: Path, tiny_model_dir: Path) -> None:
    # TP=2 on CPU needs one core list per rank; on a 2-core machine "0|1".
    # Nothing else is needed: the CPU platform picks the "mp" backend (gloo).
    assert ENGINE_PYTHON is not None
    launch = EngineLaunch(
        engine_python=ENGINE_PYTHON,
        model_dir=str(tiny_model_dir),
        served_model_name="tiny",
        engine_args={
            "tensor_parallel_size": 2,
            "load_format": "dummy",
            "max_model_len": 2048,
            "enforce_eager": True,  # no torch.compile warm-up: ~6 CPU-s less a rank
        },
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        port=8144,
        startup_timeout_s=600,
        log_path=str(tmp_path / "tp2.log"),
    )
    job = RunJob(run_id="tp2", launch=launch, workload=_workload(num_requests=2))
    result = execute(job)
    assert result.status == "succeeded", result.error
    assert "VLLM_CPU_OMP_THREADS_BIND='0|1'" in result.engine_log
    assert "world_size=2" in result.engine_log
    # VLLM_CPU_KVCACHE_SPACE (1 GiB by default) is per rank: TP=2 has twice the tokens.
    assert result.engine_info["kv_cache_size_tokens"] == 2 * 2_097_152
    _assert_no_engine_left([result])
