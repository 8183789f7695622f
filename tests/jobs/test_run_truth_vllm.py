"""Run truth on a real vLLM CPU server (tiny model): killing any process of the engine
mid-measurement fails the run (``partial``, what was measured kept) with the engine's
real error lines, stops the load at once and leaves no process behind.

One server per case (a killed engine cannot be shared): the API server process (the
launcher, pid = process group) and ``VLLM::EngineCore``, each found by its title under
the run's process group and SIGKILLed once 30 measured requests finished.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import jobs.run.runner as runner
from jobs.engine.processes import group_members
from jobs.engine.server import EngineServer
from jobs.run.runner import execute_batch
from jobs.schemas import BatchJob, EngineLaunch, Progress, RunSegment, WorkloadSpec
from tests.conftest import ENGINE_PYTHON, needs_engine

pytestmark = [pytest.mark.engine, needs_engine]

PLANNED = 2000


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _victim(kind: str, pgid: int) -> int:
    """The pid of the engine's ``kind`` process, found by title under its process group."""
    for pid in group_members(pgid):
        title = _title(pid)
        if kind == "api_server" and "vllm_launcher.py serve" in title:
            return pid
        if kind != "api_server" and title.startswith(kind):
            return pid
    raise AssertionError(f"no {kind} in group {pgid}: {[_title(p) for p in group_members(pgid)]}")


@pytest.mark.parametrize("kind", ["api_server", "VLLM::EngineCore"])
def test_killing_an_engine_process_mid_measurement_fails_the_run(
    kind: str, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ENGINE_PYTHON is not None
    servers: list[EngineServer] = []

    class Recorded(EngineServer):
        def start(self) -> None:
            super().start()
            servers.append(self)

    monkeypatch.setattr(runner, "EngineServer", Recorded)
    killed: list[tuple[int, float]] = []
    progress: list[Progress] = []

    def on_progress(p: Progress) -> None:
        progress.append(p)
        if p.phase == "measuring" and p.requests_done >= 30 and not killed:
            assert servers[0].pgid is not None
            pid = _victim(kind, servers[0].pgid)
            os.kill(pid, signal.SIGKILL)
            killed.append((pid, time.monotonic()))

    workload = WorkloadSpec.model_validate(
        {
            "num_requests": PLANNED,
            "concurrency": 4,
            "prefix_tokens": 64,
            "output_tokens": 16,
            "warmup_requests": 1,
        }
    )
    job = BatchJob(
        launch=EngineLaunch(
            engine_python=ENGINE_PYTHON,
            model_dir=str(tiny_model_dir),
            served_model_name="tiny",
            engine_args={"load_format": "dummy", "max_model_len": 2048, "enforce_eager": True},
            startup_timeout_s=600,
            log_path=str(tmp_path / "server.log"),
            env={"VLAB_RUN_ID": f"truth-{os.getpid()}-{kind}"},
        ),
        segments=[RunSegment(run_id="r0", workload=workload)],
        scrape_interval_s=0.5,
        request_timeout_s=60,
    )
    [result] = execute_batch(job, progress=on_progress)
    ended = time.monotonic()
    assert killed, "the run never measured 30 requests"
    pid, killed_at = killed[0]
    error = result.error or ""
    assert result.status == "failed" and result.partial, (result.status, error)
    if kind == "api_server":
        assert f"(pid {pid}) was killed by signal SIGKILL" in error, error
    else:
        assert f"VLLM::EngineCore (pid {pid})" in error and "is gone" in error, error
        assert "EngineDeadError" in error or "exited unexpectedly" in error, error
    assert "ulimit" not in error  # vLLM's start-up warning is not the engine's error
    measured = [r for r in result.requests if not r.warmup]
    assert 30 <= len(measured) < PLANNED / 2
    # the load stopped at the first sign: at most a few requests met the closed port
    refused = [r for r in measured if (r.error or "").startswith("connection refused")]
    assert len(refused) <= 4, len(refused)
    assert result.metrics["completed"] >= 30
    assert ended - killed_at < 15, ended - killed_at  # detection, stop and tear-down
    done = progress[-1]
    assert (done.phase, done.requests_done, done.requests_total) == ("done", len(measured), PLANNED)
    assert all(p.requests_done <= p.requests_total for p in progress if p.phase != "warmup")
    pgid = result.engine_info["pgid"]
    assert group_members(pgid) == []
    print(f"{kind}: run ended {ended - killed_at:.2f} s after the kill; {len(measured)} measured")
    print(error[:1500])
