"""The runner puts each run's engine events on its own timeline
(:func:`jobs.run.runner.execute_batch`,
``engine_info["engine_events"]``, :func:`jobs.signals.engineevents.segment_info`).

A fake engine python (test double, like ``test_runner_batch.py``'s) serves a tiny
OpenAI-compatible API and, at given chat requests, writes vLLM-format log records with
the current local time (``vllm/logger.py``: ``%(levelname)s %(asctime)s
[%(fileinfo)s:%(lineno)d] %(message)s``, ``_DATE_FORMAT = "%m-%d %H:%M:%S"``): V0's
preemption warning (``vllm/core/scheduler.py``, GAIR-NLP/LIMO#29), a V1 stats line with
``Preemptions: N`` (``vllm/v1/metrics/loggers.py:310``) and a raw traceback line without
a time. It sleeps around them so the two runs' seconds do not overlap.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path
from typing import Any

from jobs.run.runner import execute_batch
from jobs.schemas import BatchJob, EngineLaunch, RunSegment, WorkloadSpec

FAKE_ENGINE = """\
#!{python}
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
state = {{"chats": 0}}


def log(line):
    print(line.replace("NOW", time.strftime("%m-%d %H:%M:%S")), flush=True)


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
        state["chats"] += 1
        n = state["chats"]
        if n == 2:  # run r0, its first measured request
            log("WARNING NOW scheduler.py:1560] Sequence group 2 is preempted by "
                "PreemptionMode.RECOMPUTE mode because there is not enough KV cache space. "
                "total_num_cumulative_preemption=1")
            time.sleep(1.3)
        if n == 5:  # run r1, its first measured request
            time.sleep(1.3)
            log(f"(APIServer pid={{os.getpid()}}) INFO NOW [loggers.py:336] Engine 000: Avg "
                "prompt throughput: 9.0 tokens/s, Avg generation throughput: 4.0 tokens/s, "
                "Running: 1 reqs, Waiting: 0 reqs, Preemptions: 2, CPU KV cache usage: 9.0%")
            log("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(req["max_tokens"]):
            chunk = {{"choices": [{{"delta": {{"content": "x"}}}}]}}
            self.wfile.write(f"data: {{json.dumps(chunk)}}\\n\\n".encode())
        usage = {{"choices": [], "usage": {{"prompt_tokens": 100,
                  "completion_tokens": req["max_tokens"]}}}}
        self.wfile.write(f"data: {{json.dumps(usage)}}\\n\\ndata: [DONE]\\n\\n".encode())
        self.wfile.flush()
        self.close_connection = True


{on_sigterm}
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _job(tmp_path: Path, model_dir: Path, runs: int, on_sigterm: str = "") -> BatchJob:
    """A batch of ``runs`` small runs on one server of :data:`FAKE_ENGINE` (with
    ``on_sigterm`` run when vlab stops it)."""
    engine = tmp_path / "fake_engine_events"
    engine.write_text(FAKE_ENGINE.format(python=sys.executable, on_sigterm=on_sigterm))
    engine.chmod(engine.stat().st_mode | stat.S_IXUSR)
    spec = {"num_requests": 2, "prefix_tokens": 64, "output_tokens": 4, "warmup_requests": 1}
    workload = WorkloadSpec.model_validate(spec)
    return BatchJob(
        launch=EngineLaunch(
            engine_python=str(engine),
            model_dir=str(model_dir),
            served_model_name="tiny",
            startup_timeout_s=120,
            log_path=str(tmp_path / "server.log"),
        ),
        segments=[RunSegment(run_id=f"r{i}", workload=workload) for i in range(runs)],
        scrape_interval_s=0.5,
        request_timeout_s=60,
    )


def test_batch_runs_get_the_events_of_their_own_seconds(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    r0, r1 = execute_batch(_job(tmp_path, tiny_model_dir, runs=2))
    assert (r0.status, r1.status) == ("succeeded", "succeeded"), (r0.error, r1.error)

    (pre,) = r0.engine_info["engine_events"]
    assert pre["type"] == "preemption" and pre["placement"] == "placed"
    assert pre["details"] == {"preemption_mode": "RECOMPUTE", "cumulative_preemptions": 1}
    # logged when the first measured request arrived: its start on the run's clock, the
    # record's whole second at most 1 s earlier
    first = next(r for r in r0.requests if not r.warmup)
    assert first.start_s - 1.05 <= pre["t_s"] <= first.start_s + 0.5
    assert r0.engine_info["engine_events_summary"] == {
        "total": 1,
        "kept": 1,
        "by_type": {"preemption": 1},
        "unplaced": 0,
    }

    stats_pre, oom = r1.engine_info["engine_events"]
    assert stats_pre["type"] == "preemption" and stats_pre["details"] == {"preemptions": 2}
    assert stats_pre["source"] == "APIServer" and stats_pre["placement"] == "placed"
    assert 0.0 <= stats_pre["t_s"] <= r1.timings["total_s"]
    assert oom["type"] == "out_of_memory" and oom["placement"] == "unplaced"
    assert oom["t_s"] is None and oom["after_t_s"] == stats_pre["t_s"]
    assert "stats_notes" not in r0.engine_info and "stats_notes" not in r1.engine_info


#: vLLM 0.32.0's shutdown on SIGTERM, from a real engine.log (``vllm032_cpu_shutdown.log``:
#: the trigger line, ``AsyncLLM output_handler failed.``, the ``EngineDeadError``
#: traceback), logged at the current second by the fake engine when vlab stops it.
ON_SIGTERM = """
import signal
SHUTDOWN = {lines!r}


def on_sigterm(signum, frame):
    for line in SHUTDOWN:
        log(line)
    os._exit(0)


signal.signal(signal.SIGTERM, on_sigterm)
"""


def test_the_engine_vlab_stops_after_measuring_did_not_die(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The last run of a server has vLLM's shutdown (after vlab's SIGTERM) in its seconds:
    its ``EngineDeadError`` lines are no ``engine_dead`` event of the run."""
    real = Path(__file__).parent / "data" / "enginelog" / "vllm032_cpu_shutdown.log"
    lines = [ln.replace("12-06 22:17:51", "NOW") for ln in real.read_bytes().decode().split("\n")]
    hook = ON_SIGTERM.format(lines=[ln for ln in lines[4:] if ln])
    (r0,) = execute_batch(_job(tmp_path, tiny_model_dir, runs=1, on_sigterm=hook))
    assert r0.status == "succeeded", r0.error
    assert "trigger received signal=SIGTERM" in r0.engine_log
    assert "EngineDeadError" in r0.engine_log  # logged in the run's last second
    events: list[dict[str, Any]] = r0.engine_info["engine_events"]
    assert [e["type"] for e in events] == ["preemption"]  # the one the fake logged mid-run
    assert "engine_dead" not in r0.engine_info["engine_events_summary"]["by_type"]
