"""A capacity segment end to end through :func:`jobs.run.runner.execute_batch`, without vLLM.

The engine python is a test double that serves the project's stub server
(:mod:`jobs.stub.stubserver`) in its capacity mode: ``slots`` requests served at once
(FIFO), each for a fixed ``ttft + (n - 1) * itl``. With 4 output tokens, TTFT 40 ms
and ITL 80 ms a request holds a slot S = 280 ms; in a closed loop at concurrency ``c``
no request waits for a slot while ``c <= slots``, and from ``slots + 1`` on some wait a
whole service time, so a p90 TTFT objective of base + S / 2 holds exactly up to
``slots``. The base TTFT and S are measured on this machine right before the search
(:func:`tests.jobs.test_capacity.measured_baseline`), so a busy machine moves the
objective as it moves the TTFTs; S / 2 = 140 ms stays well above a loaded machine's
single delays.
The search's own accuracy is tested in ``tests/jobs/test_capacity.py`` and
``tests/jobs/test_capacity_steady.py``; here: the runner's steps (reset, the same
request list's first requests, the plan's length and warm-up, progress, signals, the
load asked and arrived, the client's CPU, the drain cut), the result and the run's
kept records, and a dead engine failing the run. Steps are short (``min_step_s`` 1 s).
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from jobs.capacity.loadsteps import step_signals
from jobs.capacity.search import CapacitySpec, StepPlan
from jobs.run.runner import execute_batch
from jobs.schemas import (
    BatchJob,
    EngineLaunch,
    MetricSample,
    Progress,
    RequestRecord,
    RunSegment,
    WorkloadSpec,
)
from jobs.stub.stubserver import StubServer
from tests.jobs.test_capacity import measured_baseline
from tests.jobs.test_runner_batch import _assert_no_engine_left, _fake_engine

REPO = Path(__file__).resolve().parents[2]

STUB_ENGINE = """\
#!{python}
# Test double for the engine venv's python: the project's stub server, capacity mode.
import sys
sys.path.insert(0, {repo!r})
argv = sys.argv

def opt(name, default):
    return argv[argv.index(name) + 1] if name in argv else default

print("INFO stub engine starting", flush=True)
from jobs.stub.stubserver import main
main([
    "--host", opt("--host", "127.0.0.1"), "--port", opt("--port", "0"),
    "--model", opt("--served-model-name", "stub"),
    "--ttft-ms", opt("--stub-ttft-ms", "40"), "--itl-ms", opt("--stub-itl-ms", "40"),
    "--slots", opt("--stub-slots", "2"),
])
"""


def _stub_engine(tmp_path: Path) -> str:
    path = tmp_path / "stub_engine"
    path.write_text(STUB_ENGINE.format(python=sys.executable, repo=str(REPO)))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _job(
    tmp_path: Path,
    model_dir: Path,
    engine_python: str,
    segments: list[RunSegment],
    engine_args: dict[str, object] | None = None,
) -> BatchJob:
    return BatchJob(
        launch=EngineLaunch(
            engine_python=engine_python,
            model_dir=str(model_dir),
            served_model_name="tiny",
            engine_args=engine_args or {"stub_slots": 2},
            startup_timeout_s=120,
            log_path=str(tmp_path / "server.log"),
        ),
        segments=segments,
        scrape_interval_s=0.2,
        request_timeout_s=60,
    )


def _closed(**kw: object) -> WorkloadSpec:
    doc: dict[str, object] = {
        "num_requests": 40,
        "prefix_tokens": 64,
        "question_tokens": 8,
        "output_tokens": 4,
        "warmup_requests": 1,
        "seed": 5,
    }
    doc.update(kw)
    return WorkloadSpec.model_validate(doc)


SHORT = {
    "min_step_s": 1.0,
    "step_time_factor": 1.0,
    "max_step_s": 20.0,
    "remeasure": 0,
    "calibrate_client": False,  # one test below calibrates (about 8 s a run)
}
#: the slots test's stub engine: 2 slots, TTFT 40 ms, ITL 80 ms (S = 280 ms for 4 tokens)
SLOTS_STUB = {"stub_slots": 2, "stub_ttft_ms": 40, "stub_itl_ms": 80}


def _concurrency_spec() -> tuple[CapacitySpec, float]:
    """The slots test's search and its p90 TTFT objective (ms): base + S / 2, both measured
    now on a stub like the engine's. p90: ~46 requests a step (the order-statistic
    interval bounds it both ways; a p99 would need ~370 requests to ever pass)."""
    with StubServer(0.04, 0.08, slots=2, process=True) as stub:
        base_p90_ms, service_s = measured_baseline(stub.base_url, 4, count=12)
    assert service_s >= 0.28  # never faster than promised
    objective = base_p90_ms + service_s * 1000 / 2
    doc = {"slos": {"ttft_ms": {"p90": objective}}, "variable": "concurrency", "min": 1}
    return CapacitySpec.model_validate(doc | {"max": 8} | SHORT), objective


@pytest.mark.timing
def test_capacity_segment_finds_the_slots_of_the_stub(tmp_path: Path, tiny_model_dir: Path) -> None:
    progress: list[Progress] = []
    spec, objective = _concurrency_spec()
    job = _job(
        tmp_path,
        tiny_model_dir,
        _stub_engine(tmp_path),
        [
            RunSegment(run_id="cap", workload=_closed(), capacity=spec),
            RunSegment(run_id="plain", workload=_closed(concurrency=2)),
        ],
        engine_args=SLOTS_STUB,
    )
    cap, plain = execute_batch(job, progress=progress.append)
    assert cap.status == "succeeded", cap.error
    result = cap.capacity
    assert result is not None and result.variable == "concurrency"
    trace = [(s.load, s.verdict, s.requests, s.stationarity) for s in result.steps]
    trace.append(("objective", objective))
    assert result.status == "found", trace
    assert result.capacity == 2.0 and result.interval == (2.0, 3.0)
    assert result.binding_slo is not None and result.binding_slo.startswith("ttft_ms")
    loads = [s.load for s in result.steps]
    assert loads[:2] == [1.0, 8.0] and set(loads) >= {2.0, 3.0}
    verdicts = {s.load: s.verdict for s in result.steps}
    assert verdicts[2.0] == "pass" and verdicts[3.0] == "fail"
    # a step lasts long enough for the p90 objective (36 measured) after its warm-up
    # when nobody waits (a step that queues has fewer, and fails on them)
    assert all(s.warmup_requests > 0 for s in result.steps), trace
    passed = [s for s in result.steps if s.verdict == "pass"]
    assert all(s.requests >= 36 and s.stationary is True for s in passed), trace
    # the stub's /metrics: busy slots and the FIFO queue, seen during the steps
    at_8 = next(s for s in result.steps if s.load == 8.0)
    assert at_8.signals.waiting_max is not None and at_8.signals.waiting_max > 0
    # the load generator's CPU is measured in every step (one process)
    assert all(s.signals.client_cpu is not None for s in result.steps)
    assert all(s.signals.client_workers == 1 for s in result.steps)

    # the run keeps the step at the capacity as its records: the first requests of the
    # list in order, its warm-up part marked (left out of the summary)
    kept = result.steps[cap.engine_info["capacity_kept_step"]]
    assert kept.load == 2.0 and kept.verdict == "pass"
    step_records = [r for r in cap.requests if r.index >= 0]
    assert [r.index for r in step_records] == list(range(len(step_records)))
    measured = [r for r in step_records if not r.warmup]
    assert len(measured) == kept.requests and len(step_records) - len(measured) == (
        kept.warmup_requests
    )
    assert cap.engine_info["capacity_steps"] == len(result.steps)
    assert cap.metrics["completed"] == kept.requests
    assert cap.metrics["p90_ttft_ms"] < objective
    assert cap.metrics["capacity"] == 2.0
    assert (cap.metrics["capacity_low"], cap.metrics["capacity_high"]) == (2.0, 3.0)
    assert "capacity_per_device" not in cap.metrics  # the orchestrator knows the devices
    assert cap.engine_info["prefix_cache_reset_ok"] is True
    assert cap.timings["measure_s"] > 0
    phases = [s.phase for s in cap.samples]
    assert phases[0] == "before" and phases[-1] == "after"
    assert set(phases[1:-1]) == {"during"}  # one run's series over the whole search

    # progress names each step and its verdict
    messages = [p.message for p in progress if p.run_id == "cap" and p.phase == "measuring"]
    assert "capacity step 1: concurrency 1" in messages
    assert "capacity step 2: concurrency 8: fail" in messages
    assert sum(m.endswith((": pass", ": fail")) for m in messages) == len(result.steps)

    # an ordinary run after it on the same server is untouched
    assert plain.status == "succeeded" and plain.capacity is None
    assert plain.metrics["completed"] == 40 and "capacity" not in plain.metrics
    assert plain.engine_info["server_reused"] is True
    _assert_no_engine_left([cap, plain])


@pytest.mark.timing
def test_capacity_over_request_rate_drives_open_loop_steps(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    # 8 slots of 160 ms: 50 req/s. Steps of 64 requests (the floor) at 16 req/s, more
    # at higher loads; the step at 128 req/s is overloaded and cut 1 s after its last
    # arrival (max_drain_s)
    spec = CapacitySpec.model_validate(
        {"slos": {"ttft_ms": {"p50": 300}}, "min": 16, "max": 128, "tolerance": 0.5}
        | {"max_steps": 3, "max_drain_s": 1.0}
        | SHORT
        | {"load_workers": 2}  # two load-generator processes share each step's schedule
    )
    workload = _closed(arrival="constant", request_rate=1.0, concurrency=256, num_requests=12)
    job = _job(
        tmp_path,
        tiny_model_dir,
        _stub_engine(tmp_path),
        [RunSegment(run_id="rate", workload=workload, capacity=spec)],
        engine_args={"stub_slots": 8},
    )
    (run,) = execute_batch(job)
    assert run.status == "succeeded", run.error
    result = run.capacity
    assert result is not None and result.variable == "request_rate"
    trace = [
        (s.load, s.verdict, s.requests, s.saturated, s.saturation_evidence, s.signals)
        for s in result.steps
    ]
    assert len(result.steps) >= 2, trace
    first, top = result.steps[0], result.steps[1]
    assert (first.load, top.load) == (16.0, 128.0), trace
    # requests_per_step (default num_requests, 12) is a floor raised to 64: a steady state
    assert first.requests + first.warmup_requests == 64
    assert first.verdict == "pass" and first.stationary is True, trace
    # the load asked and the load that arrived, in every step
    for s in result.steps:
        assert s.signals.asked_rate == pytest.approx(s.load, rel=0.01)
        assert s.signals.arrived_rate is not None and s.signals.arrived_rate > 0
        assert s.signals.client_cpu is not None and s.signals.client_cpu < 0.9
        assert s.signals.client_workers == 2
    assert top.verdict == "fail" and top.saturated, trace
    assert top.client_limit is None and top.saturation_evidence
    measured = [r for r in run.requests if not r.warmup]
    kept = result.steps[run.engine_info["capacity_kept_step"]]
    assert len(measured) == kept.requests
    # open loop: every request had a due time, from the step's own rate
    assert all(r.scheduled_s is not None for r in measured)
    assert run.engine_info["request_list_hash"]
    if result.status == "found":
        assert run.metrics["capacity"] == result.capacity
    else:
        assert "capacity" not in run.metrics
    _assert_no_engine_left([run])


@pytest.mark.timing
def test_a_request_rate_search_calibrates_the_load_generator_first(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    # the stub engine (64 slots of 160 ms: 400 req/s) passes 16 and 32 req/s; before the
    # first step the load generator is calibrated against a stub of its own, and the
    # search is given what the calibration found
    spec = CapacitySpec.model_validate(
        {"slos": {"ttft_ms": {"p50": 400}}, "min": 16, "max": 32, "max_steps": 2}
        | SHORT
        | {"calibrate_client": True}
    )
    workload = _closed(arrival="constant", request_rate=1.0, concurrency=64, num_requests=12)
    job = _job(
        tmp_path,
        tiny_model_dir,
        _stub_engine(tmp_path),
        [RunSegment(run_id="calibrated", workload=workload, capacity=spec)],
        engine_args={"stub_slots": 64},
    )
    (run,) = execute_batch(job)
    assert run.status == "succeeded", run.error
    calibration = run.engine_info["client_ceiling"]
    assert "error" not in calibration, calibration
    assert calibration["workers"] == 1 and calibration["steps"]
    for step in calibration["steps"]:  # each ramp step keeps its evidence
        assert step["asked_rate"] > 0 and step["requests"] >= 20
    given = (
        None
        if calibration["at_least"] or calibration["stub_limited"]
        else calibration["ceiling_rps"]
    )
    assert run.capacity is not None
    assert run.capacity.client_ceiling == given
    assert run.capacity.status == "at_least_max", [(s.load, s.verdict) for s in run.capacity.steps]
    _assert_no_engine_left([run])


@pytest.mark.timing
def test_engine_dying_mid_search_fails_the_run_and_keeps_what_was_measured(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    # the fake engine answers 1 warm-up + 64 requests (the first step: the floor at
    # 20 req/s) + 10, then dies (in the search's 2nd step)
    spec = CapacitySpec.model_validate(
        {"slos": {"ttft_ms": {"p50": 500}}, "min": 20, "max": 100} | SHORT
    )
    workload = _closed(arrival="constant", request_rate=1.0, concurrency=16, num_requests=20)
    job = _job(
        tmp_path,
        tiny_model_dir,
        _fake_engine(tmp_path, die_after=1 + 64 + 10),
        [RunSegment(run_id="dies", workload=workload, capacity=spec)],
        engine_args={},
    )
    (run,) = execute_batch(job)
    assert run.status == "failed" and run.partial
    assert "died" in (run.error or "")
    result = run.capacity
    assert result is not None
    assert result.note is not None and "cut short" in result.note
    assert len(result.steps) == 1  # the cut step is no measurement
    assert run.engine_info["capacity_steps"] == 2
    assert not {"capacity", "capacity_low", "capacity_high"} & set(run.metrics)
    _assert_no_engine_left([run])


def test_step_signals_read_the_queue_at_the_last_dispatch_not_after_it_drained() -> None:
    # an overloaded step: the queue grows 0 -> 20 while requests are sent (0-2 s), then
    # drains to 0 before the step's last scrape (4 s)
    samples = [
        MetricSample(t_s=t, phase="during", values={"num_requests_waiting": w})
        for t, w in [(0.0, 0.0), (1.0, 10.0), (2.0, 20.0), (3.0, 8.0), (4.0, 0.0)]
    ]
    records = [
        RequestRecord(index=i, success=True, start_s=i * 0.1, ttft_s=0.1, e2el_s=0.2)
        for i in range(21)
    ]
    signals = step_signals(samples, records)
    assert (signals.waiting_first, signals.waiting_last, signals.waiting_max) == (0.0, 20.0, 20.0)
    # with the step's plan, the queue is read from its measured part (after the warm-up)
    plan = StepPlan(
        load=10.0,
        variable="request_rate",
        requests=21,
        span_s=2.0,
        warmup_requests=10,
        warmup_s=1.0,
        drain_s=30.0,
        in_flight=64,
    )
    due = [r.model_copy(update={"scheduled_s": r.start_s}) for r in records]
    assert step_signals(samples, due, plan).waiting_first == 10.0
    counters = [
        MetricSample(t_s=t, phase=p, values={"num_preemptions": n})  # type: ignore[arg-type]
        for t, p, n in [(0.0, "before", 3.0), (1.0, "during", 5.0), (4.0, "after", 9.0)]
    ]
    assert step_signals(counters, records).preemptions == 6.0
