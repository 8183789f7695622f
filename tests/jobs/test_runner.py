"""Tests of :func:`jobs.run.runner.execute`.

Without vLLM: a fake engine python (test double) that crashes or hangs, to
check that failures and cancellation become a :class:`RunResult` and that no
process is left. With vLLM (``@pytest.mark.engine``, ``VLAB_ENGINE__PYTHON``
pointing at the engine venv's python): a real run on the tiny model with APC
off (APC on: tests/jobs/test_runner_real_vllm.py, on the runner tests' shared server).
"""

from __future__ import annotations

import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from jobs.engine.processes import group_members
from jobs.run.runner import execute
from jobs.run.segment import drop_unobserved_gauges, itl_burst_fraction, parse_engine_log
from jobs.schemas import EngineLaunch, RequestRecord, RunJob, RunResult, WorkloadSpec
from tests.conftest import ENGINE_PYTHON, needs_engine

FAKE_ENGINE_PYTHON = """\
#!{python}
# Test double for the engine venv's python (see tests/jobs/test_engine.py).
import sys, time
print("INFO fake engine starting", flush=True)
if {crash!r}:
    print("ERROR fake engine: CPU KV cache does not fit", flush=True)
    sys.exit(1)
while True:
    time.sleep(0.2)
"""


def _fake_engine(tmp_path: Path, crash: bool) -> str:
    path = tmp_path / f"fake_engine_python_{'crash' if crash else 'hang'}"
    path.write_text(FAKE_ENGINE_PYTHON.format(python=sys.executable, crash=crash))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _job(
    tmp_path: Path,
    model_dir: Path,
    engine_python: str,
    engine_args: dict[str, object] | None = None,
    **workload: int,
) -> RunJob:
    spec = {"num_requests": 4, "prefix_tokens": 256, "output_tokens": 8, "warmup_requests": 1}
    spec.update(workload)
    return RunJob(
        run_id="r-test",
        launch=EngineLaunch(
            engine_python=engine_python,
            model_dir=str(model_dir),
            served_model_name="tiny",
            engine_args=engine_args or {},
            port=0,
            startup_timeout_s=600,
            log_path=str(tmp_path / "server.log"),
        ),
        workload=WorkloadSpec.model_validate(spec),
        scrape_interval_s=0.5,
        request_timeout_s=120,
    )


def _assert_no_engine_left(result: RunResult) -> None:
    pgid = result.engine_info.get("pgid")
    if pgid is not None:
        assert group_members(pgid) == []


def test_parse_engine_log() -> None:
    log = (
        "(APIServer pid=1) INFO [api_utils.py:347] banner version 0.32.0\n"
        "(EngineCore pid=2) INFO Initializing a V1 LLM engine (v0.32.0) with config: ...\n"
        "(EngineCore pid=2) INFO CPU KV cache size: 2,097,152 tokens, Maximum concurrency "
        "for 2,048 tokens per request: 1024.00x\n"
    )
    info = parse_engine_log(log)
    assert info == {
        "vllm_version": "0.32.0",
        "kv_cache_size_tokens": 2097152,
        "kv_cache_device": "CPU",
        "kv_cache_max_concurrency": 1024.0,
        "kv_cache_max_concurrency_len": 2048,
    }
    assert parse_engine_log("nothing") == {}


def test_execute_engine_crash_is_a_failed_result(tmp_path: Path, tiny_model_dir: Path) -> None:
    phases: list[str] = []
    job = _job(tmp_path, tiny_model_dir, _fake_engine(tmp_path, crash=True))
    result = execute(job, progress=lambda p: phases.append(p.phase))
    assert result.status == "failed"
    assert result.error is not None and "CPU KV cache does not fit" in result.error
    assert "fake engine starting" in result.engine_log
    assert result.engine_info["request_list_hash"]
    assert result.engine_info["pgid"] > 0
    assert phases[:2] == ["starting", "waiting_health"] and phases[-1] == "done"
    assert "stopping" in phases
    _assert_no_engine_left(result)


def test_execute_cancel_during_startup(tmp_path: Path, tiny_model_dir: Path) -> None:
    cancel = threading.Event()
    job = _job(tmp_path, tiny_model_dir, _fake_engine(tmp_path, crash=False))
    threading.Timer(1.0, cancel.set).start()
    t = time.monotonic()
    result = execute(job, cancel=cancel)
    assert time.monotonic() - t < 30
    assert result.status == "cancelled"
    _assert_no_engine_left(result)


def test_execute_bad_model_dir_fails_without_engine(tmp_path: Path) -> None:
    job = _job(tmp_path, tmp_path / "missing-model", _fake_engine(tmp_path, crash=False))
    result = execute(job)
    assert result.status == "failed"
    assert result.error is not None and "request list" in result.error
    _assert_no_engine_left(result)


# --------------------------------------------------------------------------- real vLLM

#: enforce_eager: no torch.compile warm-up, about 6 CPU-s less a start on the 2-core machine
#: (docs/BENCHMARKS.md); no test here is about compilation.
ENGINE_ARGS = {"load_format": "dummy", "max_model_len": 2048, "enforce_eager": True}


@pytest.mark.engine
@needs_engine
def test_execute_real_apc_off(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert ENGINE_PYTHON is not None
    job = _job(
        tmp_path,
        tiny_model_dir,
        ENGINE_PYTHON,
        {**ENGINE_ARGS, "enable_prefix_caching": False},
    )
    result = execute(job)
    assert result.status == "succeeded", result.error
    assert "--no-enable-prefix-caching" in result.engine_info["command"]
    assert result.metrics["prefix_cache_hits_delta"] == 0
    assert result.metrics.get("prefix_cache_hit_rate", 0.0) == 0
    _assert_no_engine_left(result)


def test_itl_burst_fraction_counts_gaps_that_arrived_together() -> None:
    def rec(gaps: list[float], **kw: object) -> RequestRecord:
        return RequestRecord(index=0, success=True, start_s=0.0, itl_s=gaps, **kw)  # type: ignore[arg-type]

    assert itl_burst_fraction([rec([0.003, 0.00002, 0.00003, 0.004])]) == 0.5
    assert itl_burst_fraction([rec([0.00001], warmup=True), rec([0.002])]) == 0.0
    assert itl_burst_fraction([rec([])]) is None


def test_gauge_peaks_no_scrape_saw_are_dropped_not_zero() -> None:
    unseen = {
        "completed": 4.0,
        "num_requests_running_peak": 0.0,
        "num_requests_waiting_peak": 0.0,
        "kv_cache_usage_peak": 0.0,
        "kv_cache_usage_mean": 0.0,
        "prefix_cache_hits_delta": 10.0,
    }
    note = drop_unobserved_gauges(unseen)
    assert note and "not reported" in note
    assert unseen == {"completed": 4.0, "prefix_cache_hits_delta": 10.0}
    seen = {"completed": 4.0, "num_requests_running_peak": 2.0, "kv_cache_usage_peak": 0.1}
    assert drop_unobserved_gauges(dict(seen)) is None
    idle = {"completed": 0.0, "num_requests_running_peak": 0.0, "kv_cache_usage_peak": 0.0}
    assert drop_unobserved_gauges(idle) is None and "kv_cache_usage_peak" in idle
