"""Capacity under SLOs through the REST API: submission checks, the stored search served.

A capacity experiment is submitted like any other; its problems are 422 naming the
field. A run's result with a capacity search is recorded by the runs' own use case
(:func:`orchestrator.runs.service.record_result`) and served by ``GET /api/v1/runs/{id}``
(``capacity``: the stored document; the summary metrics ``capacity``,
``capacity_per_device``, ``capacity_low``, ``capacity_high``).
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from jobs.capacity.search import CapacityResult, CapacitySpec, CapacityStep, SLOCheck
from jobs.run.runner import execute_batch
from jobs.schemas import RequestRecord, RunResult
from orchestrator.core.models import Run
from orchestrator.core.repositories import RunRepository
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus
from orchestrator.runs.launch import build_batch_job
from orchestrator.runs.service import record_result
from tests.conftest import ENGINE_PYTHON, needs_engine

PROBLEM = "application/problem+json"


def capacity_spec(**capacity: Any) -> dict[str, Any]:
    return {
        "name": "capacity test",
        "model": "tiny",
        "baseline": {
            "engine_args": {"enable_prefix_caching": False, "max_model_len": 1024},
            "layout": {"devices": 2},
            "workload": {
                "num_requests": 10,
                "prefix_tokens": 128,
                "seed": 3,
                "arrival": "poisson",
                "request_rate": 1.0,
                "concurrency": 64,
            },
        },
        "variants": [{"name": "apc-on", "changes": {"engine_args.enable_prefix_caching": True}}],
        "repeats": 1,
        "capacity": {"slos": {"ttft_ms": {"p50": 500}}, "min": 0.5, "max": 16, **capacity},
    }


def _step(index: int, load: float, verdict: str) -> CapacityStep:
    check = SLOCheck(
        metric="ttft_ms",
        percentile="p99",
        objective=500.0,
        value=300.0 if verdict == "pass" else 900.0,
        ci_low=250.0 if verdict == "pass" else 800.0,
        ci_high=350.0 if verdict == "pass" else 1000.0,
        verdict=verdict,  # type: ignore[arg-type]
    )
    return CapacityStep(
        index=index,
        load=load,
        requests=10,
        failed=0,
        duration_s=5.0,
        percentiles={"ttft_ms": {"p99": check.value or 0.0}},
        checks=[check],
        verdict=verdict,  # type: ignore[arg-type]
    )


def _result(run_id: str, capacity: CapacityResult) -> RunResult:
    records = [
        RequestRecord(
            index=i, success=True, start_s=i * 0.2, ttft_s=0.3, e2el_s=0.4, output_tokens=8
        )
        for i in range(10)
    ]
    return RunResult(
        run_id=run_id,
        status="succeeded",
        metrics={"completed": 10.0, "capacity": 4.0, "capacity_low": 4.0, "capacity_high": 4.4},
        requests=records,
        capacity=capacity,
    )


def _record(session_factory: sessionmaker[Session], run_id: str, result: RunResult) -> None:
    with session_factory() as s:
        run = s.get(Run, run_id)
        assert run is not None
        RunRepository(s).transition(run, RunStatus.PREPARING)
        record_result(s, run, result)
        s.commit()


def test_capacity_run_is_stored_and_served(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    resp = client.post("/api/v1/experiments", json=capacity_spec())
    assert resp.status_code == 201, resp.text
    body = resp.json()
    exp = client.get(f"/api/v1/experiments/{body['id']}").json()
    assert exp["spec"]["capacity"]["variable"] == "request_rate"
    baseline = next(r for r in body["runs"] if r["name"] == "baseline")
    queued = client.get(f"/api/v1/runs/{baseline['id']}").json()
    assert queued["capacity"] is None  # nothing measured yet
    found = CapacityResult(
        variable="request_rate",
        status="found",
        capacity=4.0,
        interval=(4.0, 4.4),
        binding_slo="ttft_ms p99",
        steps=[
            _step(0, 0.5, "pass"),
            _step(1, 16.0, "fail"),
            _step(2, 4.0, "pass"),
            _step(3, 4.4, "fail"),
        ],
    )
    _record(session_factory, baseline["id"], _result(baseline["id"], found))

    run = client.get(f"/api/v1/runs/{baseline['id']}").json()
    assert run["status"] == "succeeded"
    assert run["capacity"] == found.model_dump(mode="json")
    assert run["capacity"]["interval"] == [4.0, 4.4]
    assert [s["verdict"] for s in run["capacity"]["steps"]] == ["pass", "fail", "pass", "fail"]
    metrics = run["metrics"]
    assert metrics["capacity"] == 4.0
    assert (metrics["capacity_low"], metrics["capacity_high"]) == (4.0, 4.4)
    assert metrics["capacity_per_device"] == 2.0  # the run reserved 2 devices
    listed = client.get("/api/v1/runs", params={"experiment_id": body["id"]}).json()
    assert {r["id"]: r["capacity"] is not None for r in listed["items"]} == {
        baseline["id"]: True,
        next(r["id"] for r in body["runs"] if r["name"] == "apc-on"): False,
    }


def test_a_search_that_found_no_boundary_stores_no_capacity_metric(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    body = client.post("/api/v1/experiments", json=capacity_spec()).json()
    run_id = body["runs"][0]["id"]
    uncertain = CapacityResult(
        variable="request_rate",
        status="uncertain",
        steps=[_step(0, 0.5, "pass"), _step(1, 16.0, "uncertain")],
        note="the p99 TTFT interval straddles the objective at 16 req/s",
    )
    result = _result(run_id, uncertain)
    result.metrics = {"completed": 10.0}  # the runner gives no capacity metric then
    _record(session_factory, run_id, result)
    run = client.get(f"/api/v1/runs/{run_id}").json()
    assert run["capacity"]["status"] == "uncertain"
    assert run["capacity"]["capacity"] is None
    assert not {"capacity", "capacity_per_device", "capacity_low"} & set(run["metrics"])


def test_bad_capacity_specs_are_422_naming_the_field(client: TestClient) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        (capacity_spec(min=8, max=4), "is over max"),
        (capacity_spec(min=4, max=4), "capacity.min (4) must be below capacity.max (4)"),
        (capacity_spec(slos={}), "at least one objective"),
        (capacity_spec(slos={"ttft_ms": {"q99": 5}}), "'q99'"),
        (
            capacity_spec(slos={"ttft_ms": {}, "e2el_ms": {"p50": 900}}, goodput=0.9),
            "capacity.slos.ttft_ms: give at",
        ),
        (capacity_spec(variable="concurrency", min=1, max=8), "needs workload arrival 'closed'"),
        (capacity_spec(variable="concurrency", min=1.5, max=8), "whole number"),
        (capacity_spec(tolerence=0.01), "tolerence"),  # a misspelt key is not ignored
        (capacity_spec(slos={"ttft_ms": {"p100": 500}}), "'p100'"),
        (capacity_spec(slos={"ttft_ms": {"p50": "500"}}), "p50"),
        (capacity_spec(goodput=0.9, slos={"itl_ms": {"p50": 5}}), "goodput counts"),
        (capacity_spec(slos={"ttft_ms": {"p99": 500}}), "needs at least 368"),
    ]
    for doc, needle in cases:
        resp = client.post("/api/v1/experiments", json=doc)
        assert resp.status_code == 422, (needle, resp.text)
        assert resp.headers["content-type"].startswith(PROBLEM)
        errors = resp.json()["errors"]
        assert any(needle in e["msg"] or needle in e["loc"] for e in errors), (needle, errors)
        assert all(e["loc"][:2] in (["body", "capacity"], ["body", "baseline"]) for e in errors)


def test_a_variant_may_not_change_the_capacity_search_or_what_it_drives(
    client: TestClient,
) -> None:
    doc = capacity_spec()
    doc["variants"] = [{"name": "rate", "changes": {"workload.request_rate": 2.0}}]
    resp = client.post("/api/v1/experiments", json=doc)
    assert resp.status_code == 422, resp.text
    (err,) = resp.json()["errors"]
    assert err["loc"] == ["body", "variants", 0, "changes", "workload.request_rate"]
    assert "the capacity search drives request_rate" in err["msg"]

    doc["variants"] = [{"name": "cap", "changes": {"capacity.max": 32}}]
    resp = client.post("/api/v1/experiments", json=doc)
    assert resp.status_code == 422, resp.text
    assert "measurement setting of the whole experiment" in resp.text


def test_every_run_of_a_capacity_experiment_gets_the_search_in_its_launch_job(
    client: TestClient, session_factory: sessionmaker[Session], settings: Settings
) -> None:
    body = client.post("/api/v1/experiments", json=capacity_spec(requests_per_step=20)).json()
    with session_factory() as s:
        runs = [s.get(Run, r["id"]) for r in body["runs"]]
        jobs = [build_batch_job(settings, [run]) for run in runs if run is not None]
    assert len(jobs) == 2
    for job in jobs:
        (segment,) = job.segments
        assert segment.capacity == CapacitySpec.model_validate(
            capacity_spec(requests_per_step=20)["capacity"]
        )
        assert segment.workload.arrival == "poisson"


# --------------------------------------------------------------------------- real vLLM


@pytest.mark.engine
@needs_engine
def test_real_vllm_capacity_apc_on_vs_off(
    client: TestClient, session_factory: sessionmaker[Session], settings: Settings
) -> None:
    """APC off vs on on the tiny model over a shared prefix: each run's search on its own
    server (the launch job the dispatcher would hand on, run by :func:`execute_batch`),
    recorded by the runs' use case; the comparison serves the capacity verdict and its
    interval. Loads are few and small (concurrency 1 to 8, steps of 2-8 s, at most 6 steps, no
    re-measurement) so the test's time is bounded by design."""
    assert ENGINE_PYTHON is not None
    doc = {
        "name": "capacity apc",
        "model": "tiny",
        "baseline": {
            # enforce_eager: no torch.compile warm-up, ~6 CPU-s less a vLLM start
            "engine_args": {
                "enable_prefix_caching": False,
                "max_model_len": 2048,
                "enforce_eager": True,
            },
            "workload": {
                "num_requests": 12,
                "prefix_tokens": 1536,
                "question_tokens": 16,
                "output_tokens": 4,
                "warmup_requests": 1,
                "seed": 3,
            },
        },
        "variants": [{"name": "apc-on", "changes": {"engine_args.enable_prefix_caching": True}}],
        "repeats": 1,
        "capacity": {
            "slos": {"ttft_ms": {"p50": 250}},
            "variable": "concurrency",
            "min": 1,
            "max": 8,
            "max_steps": 6,
            "remeasure": 0,
            "min_step_s": 2.0,
            "step_time_factor": 4.0,
            "max_step_s": 8.0,
        },
    }
    resp = client.post("/api/v1/experiments", json=doc)
    assert resp.status_code == 201, resp.text
    body = resp.json()
    for brief in body["runs"]:
        with session_factory() as s:
            run = s.get(Run, brief["id"])
            assert run is not None
            job = build_batch_job(settings, [run])
        launch = job.launch.model_copy(update={"engine_python": ENGINE_PYTHON})
        (result,) = execute_batch(job.model_copy(update={"launch": launch}))
        assert result.status == "succeeded", result.error
        assert result.capacity is not None and result.capacity.steps
        _record(session_factory, brief["id"], result)

    runs = {r["name"]: client.get(f"/api/v1/runs/{r['id']}").json() for r in body["runs"]}
    for run in runs.values():
        cap = run["capacity"]
        assert cap["variable"] == "concurrency"
        assert cap["status"] in (
            "found",
            "below_min",
            "at_least_max",
            "uncertain",
            "steps_exhausted",
            "client_limited",
        )
        assert 1 <= len(cap["steps"]) <= 6
        assert all(
            s["verdict"] in ("pass", "fail", "uncertain", "client_limited") for s in cap["steps"]
        )
        for s in cap["steps"]:  # every step kept a measured part after its warm-up
            assert s["measured_s"] is not None and s["measured_s"] > 0
        if cap["status"] == "found":
            assert run["metrics"]["capacity"] == cap["capacity"]
            assert run["metrics"]["capacity_per_device"] == cap["capacity"]  # one device
            lo, hi = cap["interval"]
            assert lo == cap["capacity"] and hi is not None and hi > lo
        else:
            assert "capacity" not in run["metrics"]
    # APC makes the shared prefix a cache hit: hits only where it is on
    assert runs["apc-on"]["metrics"]["prefix_cache_hits_delta"] > 0
    assert runs["baseline"]["metrics"].get("prefix_cache_hits_delta", 0) == 0

    comp = client.get(f"/api/v1/experiments/{body['id']}/comparison").json()
    (variant,) = comp["variants"]
    capacity = variant["capacity"]
    assert capacity is not None
    assert capacity["verdict"] in ("higher", "lower", "no_change", "unknown", "untrusted")
    if capacity["verdict"] == "untrusted":
        # a step a finding flags (e.g. a client that could not keep up on a loaded machine)
        # gives no verdict: the reason names the run and the finding, and no ratio is given
        assert capacity["trustworthy"] is False and capacity["untrusted_reason"], capacity
        assert capacity["ratio"] is None, capacity
    elif capacity["verdict"] != "unknown":  # a bound's missing end is None (one-sided)
        lo, hi = capacity["ci_low"], capacity["ci_high"]
        assert lo is not None or hi is not None
        if capacity["ratio"] is not None:
            assert (lo is None or lo <= capacity["ratio"]) and (
                hi is None or capacity["ratio"] <= hi
            )
    print("capacity comparison:", capacity)
    for name, run in runs.items():
        print(
            name,
            run["capacity"]["status"],
            run["capacity"]["interval"],
            [
                (s["load"], s["verdict"], s["percentiles"].get("ttft_ms"))
                for s in run["capacity"]["steps"]
            ],
        )
