"""The REST API against a real Postgres: submission, validation problems, reads, cancel.

The engine-argument catalogue is the real list vLLM 0.32.0 printed, seeded into
the service's cache (no engine needs to start for these tests).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.models import Experiment, Run

PROBLEM = "application/problem+json"


def demo_spec(**kw: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "apc test",
        "model": "tiny",
        "baseline": {
            "engine_args": {"enable_prefix_caching": False, "max_model_len": 1024},
            "workload": {"num_requests": 4, "prefix_tokens": 128, "seed": 3},
        },
        "variants": [{"name": "apc-on", "changes": {"engine_args.enable_prefix_caching": True}}],
        "repeats": 1,
    }
    doc.update(kw)
    return doc


def count(session_factory: sessionmaker[Session], model: type) -> int:
    with session_factory() as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


def test_submit_stores_experiment_and_queued_runs(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    resp = client.post("/api/v1/experiments", json=demo_spec())
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert [r["name"] for r in body["runs"]] == ["baseline", "apc-on"]
    assert all(r["status"] == "queued" for r in body["runs"])

    exp = client.get(f"/api/v1/experiments/{body['id']}").json()
    assert exp["status"] == "queued"
    base, apc = exp["runs"]
    # the full resolved engine args: vLLM's defaults overlaid with the spec
    assert base["engine_args"]["enable_prefix_caching"] is False
    assert apc["engine_args"]["enable_prefix_caching"] is True
    assert base["engine_args"]["gpu_memory_utilization"] == 0.92
    assert base["explicit_engine_args"]["load_format"] == "dummy"
    assert base["max_model_len"] == 1024
    assert len(base["model_digest"]) == 64 and base["model_digest"] == apc["model_digest"]
    assert base["request_list_hash"] == apc["request_list_hash"]
    assert apc["reference_run_id"] == base["id"]
    assert apc["changes"] == {"engine_args.enable_prefix_caching": True}

    assert exp["variants"][1]["reference"] == "baseline"
    assert exp["variants"][1]["variable"] == "engine_args.enable_prefix_caching"
    runs = client.get("/api/v1/runs", params={"experiment_id": body["id"]}).json()
    assert runs["total"] == 2 and [r["position"] for r in runs["items"]] == [0, 1]
    one = client.get(f"/api/v1/runs/{base['id']}")
    assert one.status_code == 200 and one.json()["status"] == "queued"
    m = client.get(f"/api/v1/runs/{base['id']}/metrics").json()
    assert m == {
        "run_id": base["id"],
        "status": "queued",
        "partial": False,
        "metrics": {},
        "samples": [],
        "samples_total": 0,
    }


def test_invalid_spec_is_422_naming_every_bad_field_and_stores_nothing(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    before = (count(session_factory, Experiment), count(session_factory, Run))
    spec = demo_spec(name="")
    spec["baseline"]["workload"]["concurrency"] = 0
    spec["baseline"]["layout"] = {"tensor_parallel_size": -1}
    resp = client.post("/api/v1/experiments", json=spec)
    assert resp.status_code == 422
    assert resp.headers["content-type"].startswith(PROBLEM)
    body = resp.json()
    assert body["status"] == 422 and body["code"] == "spec_invalid"
    locs = {".".join(map(str, e["loc"])) for e in body["errors"]}
    assert {
        "body.name",
        "body.baseline.workload.concurrency",
        "body.baseline.layout.tensor_parallel_size",
    } <= locs
    assert (count(session_factory, Experiment), count(session_factory, Run)) == before


def test_unknown_engine_arg_is_refused_at_submission(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    before = count(session_factory, Run)
    spec = demo_spec()
    spec["baseline"]["engine_args"]["max_num_seq"] = 8
    spec["variants"].append({"name": "bogus", "changes": {"engine_args.no_such_knob": 1}})
    resp = client.post("/api/v1/experiments", json=spec)
    assert resp.status_code == 422
    body = resp.json()
    assert body["code"] == "spec_invalid"
    got = {(".".join(map(str, e["loc"])), e["type"]) for e in body["errors"]}
    assert ("body.baseline.engine_args.max_num_seq", "unknown_engine_arg") in got
    assert ("body.variants.1.changes.engine_args.no_such_knob", "unknown_engine_arg") in got
    assert "max_num_seqs" in json.dumps(body["errors"])  # suggestion
    assert count(session_factory, Run) == before


def test_variant_with_two_changes_is_refused(client: TestClient) -> None:
    spec = demo_spec(
        variants=[
            {
                "name": "two",
                "changes": {
                    "engine_args.enable_prefix_caching": True,
                    "engine_args.max_num_seqs": 4,
                },
            }
        ]
    )
    resp = client.post("/api/v1/experiments", json=spec)
    assert resp.status_code == 422
    assert resp.json()["errors"][0]["type"] == "more_than_one_variable"


def test_unknown_model_is_a_problem(client: TestClient) -> None:
    resp = client.post("/api/v1/experiments", json=demo_spec(model="/no/such/model"))
    assert resp.status_code == 422
    assert resp.json()["errors"][0]["loc"] == ["body", "model"]


def test_missing_things_are_404_problems(client: TestClient) -> None:
    for path in (
        "/api/v1/runs/nope",
        "/api/v1/experiments/nope",
        "/api/v1/runs/nope/metrics",
        "/api/v1/nothing-here",
    ):
        resp = client.get(path)
        assert resp.status_code == 404, path
        assert resp.headers["content-type"].startswith(PROBLEM)
        assert resp.json()["status"] == 404


def test_cancel_queued_run_ends_it(client: TestClient) -> None:
    created = client.post("/api/v1/experiments", json=demo_spec()).json()
    run_id = created["runs"][1]["id"]
    resp = client.post(f"/api/v1/runs/{run_id}/cancel")
    assert resp.status_code == 202 and resp.json()["status"] == "cancelled"
    again = client.post(f"/api/v1/runs/{run_id}/cancel")
    assert again.status_code == 409 and again.json()["code"] == "run_already_ended"
    assert client.get(f"/api/v1/runs/{run_id}").json()["status"] == "cancelled"


def test_pagination_and_health_and_openapi(client: TestClient) -> None:
    for _ in range(3):
        client.post("/api/v1/experiments", json=demo_spec())
    page = client.get("/api/v1/experiments", params={"limit": 2, "offset": 1}).json()
    assert page["limit"] == 2 and page["offset"] == 1 and len(page["items"]) == 2
    assert page["total"] >= 3
    bad = client.get("/api/v1/experiments", params={"limit": 0})
    assert bad.status_code == 422 and bad.json()["code"] == "request_invalid"
    assert client.get("/healthz").json() == {"status": "ok", "database": "ok"}
    paths = client.get("/openapi.json").json()["paths"]
    assert "/api/v1/experiments" in paths and "/api/v1/runs/{run_id}/metrics" in paths


def test_repeats_are_interleaved_and_linked_to_their_reference(client: TestClient) -> None:
    body = client.post("/api/v1/experiments", json=demo_spec(repeats=3)).json()
    assert [(r["name"], r["repeat_index"]) for r in body["runs"]] == [
        ("baseline", 0),
        ("apc-on", 0),
        ("baseline", 1),
        ("apc-on", 1),
        ("baseline", 2),
        ("apc-on", 2),
    ]
    exp = client.get(f"/api/v1/experiments/{body['id']}").json()
    assert exp["repeats"] == 3
    by_id = {r["id"]: r for r in exp["runs"]}
    for r in exp["runs"]:
        if r["name"] == "apc-on":
            ref = by_id[r["reference_run_id"]]
            assert ref["name"] == "baseline" and ref["repeat_index"] == r["repeat_index"]
    assert len({r["request_list_hash"] for r in exp["runs"]}) == 1


def test_two_variable_variant_is_422_naming_both_values(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    before = count(session_factory, Run)
    spec = demo_spec(
        variants=[
            {
                "name": "two",
                "changes": {"engine_args.enable_prefix_caching": True, "workload.concurrency": 8},
            }
        ]
    )
    resp = client.post("/api/v1/experiments", json=spec)
    assert resp.status_code == 422
    err = resp.json()["errors"][0]
    assert err["type"] == "more_than_one_variable"
    assert "workload.concurrency: 1 -> 8" in err["msg"]
    assert count(session_factory, Run) == before


def test_clone_a_run_with_one_change(client: TestClient) -> None:
    body = client.post("/api/v1/experiments", json=demo_spec(repeats=2)).json()
    apc_run = body["runs"][1]["id"]
    resp = client.post(
        f"/api/v1/runs/{apc_run}/variants",
        json={"name": "apc-c4", "changes": {"workload.concurrency": 4}},
    )
    assert resp.status_code == 201, resp.text
    new = resp.json()
    assert [r["repeat_index"] for r in new] == [0, 1]
    assert min(r["sequence"] for r in new) > max(r["sequence"] for r in body["runs"])
    exp = client.get(f"/api/v1/experiments/{body['id']}").json()
    added = [r for r in exp["runs"] if r["name"] == "apc-c4"]
    assert len(added) == 2
    assert added[0]["reference_variant"] == "apc-on"
    assert added[0]["engine_args"]["enable_prefix_caching"] is True
    assert added[0]["workload"]["concurrency"] == 4
    assert exp["variants"][-1]["reference"] == "apc-on"

    two = client.post(
        f"/api/v1/runs/{apc_run}/variants",
        json={"name": "bad", "changes": {"workload.concurrency": 4, "workload.seed": 9}},
    )
    assert two.status_code == 422
    assert two.json()["errors"][0]["type"] == "more_than_one_variable"
    same = client.post(
        f"/api/v1/runs/{apc_run}/variants",
        json={"name": "same", "changes": {"engine_args.enable_prefix_caching": True}},
    )
    assert same.status_code == 422 and same.json()["errors"][0]["type"] == "no_change"
    dup = client.post(
        f"/api/v1/runs/{apc_run}/variants",
        json={"name": "apc-c4", "changes": {"workload.concurrency": 8}},
    )
    assert dup.status_code == 422
    assert (
        client.post(
            "/api/v1/runs/nope/variants", json={"name": "x", "changes": {"workload.seed": 1}}
        ).status_code
        == 404
    )


def _finish(session_factory: sessionmaker[Session], run_id: str, ttft_s: float) -> None:
    """Record a succeeded run with 20 measured requests of the given TTFT (test data)."""
    from orchestrator.core.repositories import RunRepository

    with session_factory() as s:
        repo = RunRepository(s)
        run = s.get(Run, run_id)
        assert run is not None
        reqs = [
            {
                "index": i,
                "warmup": False,
                "success": True,
                "start_s": i * 0.1,
                "ttft_s": ttft_s * (1 + 0.01 * (i % 5)),
                "itl_s": [0.01] * 7,
                "tpot_s": 0.01,
                "e2el_s": ttft_s + 0.07,
                "prompt_tokens": 300,
                "output_tokens": 8,
            }
            for i in range(20)
        ]
        repo.save_measurements(
            run_id,
            metrics={
                "median_ttft_ms": ttft_s * 1000,
                "output_throughput": 100.0 / ttft_s,
                "completed": 20.0,
            },
            samples=[],
            requests=reqs,
            engine_log="",
        )
        run.status = "succeeded"
        s.commit()


def test_a_run_says_when_it_was_claimed(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    """``claimed_at`` is null while queued and the claim's time once a dispatcher holds
    the run (before its warm-up's ``started_at``)."""
    from orchestrator.core.repositories import RunRepository

    body = client.post("/api/v1/experiments", json=demo_spec()).json()
    assert all(client.get(r["url"]).json()["claimed_at"] is None for r in body["runs"])
    with session_factory() as s:
        claimed = RunRepository(s).claim_next_queued("orch-test")
        assert claimed is not None
        s.commit()
        run_id, at = claimed.id, claimed.claimed_at
    got = client.get(f"/api/v1/runs/{run_id}").json()
    assert got["status"] == "preparing" and got["claimed_at"] is not None
    assert got["claimed_at"].startswith(at.strftime("%Y-%m-%dT%H:%M:%S")), (got, at)


def test_comparison_and_export(client: TestClient, session_factory: sessionmaker[Session]) -> None:
    import io

    import pandas as pd

    body = client.post("/api/v1/experiments", json=demo_spec(repeats=3)).json()
    for r in body["runs"]:
        _finish(session_factory, r["id"], 0.2 if r["name"] == "baseline" else 0.05)
    comp = client.get(f"/api/v1/experiments/{body['id']}/comparison")
    assert comp.status_code == 200, comp.text
    doc = comp.json()
    assert doc["chain"][1]["variable"] == "engine_args.enable_prefix_caching"
    assert doc["chain"][1]["reference_value"] is False
    assert doc["chain"][1]["variant_value"] is True
    (variant,) = doc["variants"]
    ttft = next(m for m in variant["metrics"] if m["metric"] == "median_ttft_ms")
    assert ttft["verdict"] == "better"
    assert ttft["ratio"] < 0.3 and ttft["ci_low"] <= ttft["ratio"] <= ttft["ci_high"] < 1
    assert ttft["n_reference_repeats"] == ttft["n_variant_repeats"] == 3

    csv = client.get(f"/api/v1/experiments/{body['id']}/export", params={"format": "csv"})
    assert csv.status_code == 200 and csv.headers["content-type"].startswith("text/csv")
    df = pd.read_csv(io.BytesIO(csv.content))
    assert len(df) == 6
    assert set(df["variant"]) == {"baseline", "apc-on"}
    assert "engine_args.enable_prefix_caching" in df.columns
    assert "metrics.median_ttft_ms" in df.columns
    pq = client.get(f"/api/v1/experiments/{body['id']}/export", params={"format": "parquet"})
    assert pq.status_code == 200
    dfp = pd.read_parquet(io.BytesIO(pq.content))
    assert len(dfp) == 6 and sorted(dfp["repeat_index"].tolist()) == [0, 0, 1, 1, 2, 2]
    bad = client.get(f"/api/v1/experiments/{body['id']}/export", params={"format": "xls"})
    assert bad.status_code == 422


def test_every_problem_is_reported_at_once(client: TestClient) -> None:
    spec = demo_spec(model="/no/such/model")
    spec["baseline"]["workload"]["num_requests"] = "many"
    spec["baseline"]["engine_args"]["enable_prefix_cache"] = True
    spec["variants"].append({"name": "x", "changes": {"engine_args.max_num_seq": 2}})
    resp = client.post("/api/v1/experiments", json=spec)
    assert resp.status_code == 422
    body = resp.json()
    got = {".".join(map(str, e["loc"])): e["type"] for e in body["errors"]}
    assert got["body.baseline.workload.num_requests"].startswith("int")
    assert got["body.baseline.engine_args.enable_prefix_cache"] == "unknown_engine_arg"
    assert got["body.variants.1.changes.engine_args.max_num_seq"] == "unknown_engine_arg"
    assert got["body.model"] == "unknown_model"
    assert "num_requests" in body["detail"]  # the detail names the problems too
    not_json = client.post(
        "/api/v1/experiments", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert not_json.status_code == 422
    assert not_json.headers["content-type"].startswith(PROBLEM)


def test_human_readable_context_cap_is_stored_as_an_integer(client: TestClient) -> None:
    body = client.post(
        "/api/v1/experiments",
        json=demo_spec(baseline={"engine_args": {"max_model_len": "2K"}}, variants=[]),
    )
    assert body.status_code == 201, body.text
    run = client.get(body.json()["runs"][0]["url"]).json()
    assert run["max_model_len"] == 2048
    assert run["explicit_engine_args"]["max_model_len"] == "2K"


def test_spec_schema_is_in_openapi(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert "ExperimentSpec" in doc["components"]["schemas"]
    body = doc["paths"]["/api/v1/experiments"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ExperimentSpec")


def test_run_log_is_filtered_unless_raw(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    from orchestrator.core.repositories import RunRepository

    body = client.post("/api/v1/experiments", json=demo_spec(variants=[])).json()
    run_id = body["runs"][0]["id"]
    log = (
        'INFO:     127.0.0.1:5000 - "GET /health HTTP/1.1" 200 OK\n'
        "INFO 11-29 10:00:00 [loggers.py:1] Engine 000: Running: 1 reqs, Waiting: 0 reqs\n"
        'INFO:     127.0.0.1:5000 - "GET /health HTTP/1.1" 503 Service Unavailable\n'
    )
    with session_factory() as s:
        RunRepository(s).save_measurements(
            run_id, metrics={}, samples=[], requests=[], engine_log=log
        )
        s.commit()
    filtered = client.get(f"/api/v1/runs/{run_id}/log")
    assert filtered.status_code == 200
    assert filtered.headers["x-noise-lines-dropped"] == "1"
    assert (
        "200 OK" not in filtered.text and "503" in filtered.text and "Engine 000" in filtered.text
    )
    raw = client.get(f"/api/v1/runs/{run_id}/log", params={"raw": 1})
    assert raw.text == log


def test_clone_with_a_bad_path_is_a_422_not_a_500(client: TestClient) -> None:
    body = client.post("/api/v1/experiments", json=demo_spec()).json()
    run_id = body["runs"][0]["id"]
    resp = client.post(
        f"/api/v1/runs/{run_id}/variants", json={"name": "x", "changes": {"foo.bar": 1}}
    )
    assert resp.status_code == 422
    assert resp.headers["content-type"].startswith(PROBLEM)
    assert resp.json()["errors"][0]["loc"][:2] == ["body", "changes"]


def test_partial_run_downsampled_series_and_request_filters(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    from orchestrator.core.repositories import RunRepository

    body = client.post("/api/v1/experiments", json=demo_spec()).json()
    run_id = body["runs"][0]["id"]
    samples = [{"t_s": 0.0, "phase": "before", "values": {"kv_cache_usage": 0.0}}]
    samples += [
        {"t_s": 1.0 + i, "phase": "during", "values": {"kv_cache_usage": i / 3000}}
        for i in range(3000)
    ]
    reqs = [
        {
            "index": i,
            "warmup": i == 0,
            "request_class": "long" if i % 3 == 0 else "short",
            "success": i < 8,
            "error": None if i < 8 else "ReadTimeout: server stopped answering",
            "start_s": float(i),
            "ttft_s": 0.1 if i < 8 else None,
            "cached_tokens": 128 if i < 8 else None,
            "scheduled_s": float(i) - 0.001,
        }
        for i in range(12)
    ]
    with session_factory() as s:
        run = s.get(Run, run_id)
        assert run is not None
        RunRepository(s).save_measurements(
            run_id, metrics={"completed": 7.0}, samples=samples, requests=reqs, engine_log=""
        )
        run.status, run.partial = "failed", True
        s.commit()

    m = client.get(f"/api/v1/runs/{run_id}/metrics", params={"max_points": 50}).json()
    assert m["partial"] is True and m["samples_total"] == 3001
    assert len(m["samples"]) == 51  # before + 50 bins
    assert max(p["values"]["kv_cache_usage"] for p in m["samples"]) == pytest.approx(2999 / 3000)
    assert client.get(f"/api/v1/runs/{run_id}").json()["partial"] is True
    bad = client.get(f"/api/v1/runs/{run_id}/metrics", params={"max_points": 0})
    assert bad.status_code == 422 and bad.headers["content-type"] == PROBLEM

    page = client.get(
        f"/api/v1/runs/{run_id}/requests", params={"request_class": "long", "warmup": False}
    ).json()
    assert page["total"] == 3  # indices 3, 6, 9 (0 is the warm-up)
    assert [r["request_index"] for r in page["items"]] == [3, 6, 9]
    first = page["items"][0]
    assert first["cached_tokens"] == 128 and first["scheduled_s"] == pytest.approx(2.999)
    failed = page["items"][-1]
    assert failed["success"] is False and "stopped answering" in failed["error"]


def test_template_workload_with_slos_and_open_loop_is_accepted(client: TestClient) -> None:
    workload = {
        "kind": "template",
        "num_requests": 6,
        "seed": 1,
        "output_tokens": 8,
        "warmup_requests": 0,
        "segments": [
            {
                "name": "rules",
                "role": "system",
                "fixed": True,
                "source": "instructions",
                "tokens": {"tokens": 64},
            },
            {"name": "docs", "source": "passages", "tokens": {"tokens": 0}},
            {"name": "q", "source": "question", "tokens": {"tokens": 16, "range_ratio": 0.5}},
        ],
        "classes": [
            {"name": "short", "weight": 2},
            {"name": "long", "weight": 1, "segment_tokens": {"docs": {"tokens": 256}}},
        ],
        "arrival": "poisson",
        "request_rate": 4.0,
        "burstiness": 0.5,
    }
    spec = demo_spec(slos={"ttft_ms": 500, "e2el_ms": 2000})
    spec["baseline"]["workload"] = workload
    resp = client.post("/api/v1/experiments", json=spec)
    assert resp.status_code == 201, resp.text
    exp = client.get(resp.json()["url"]).json()
    assert exp["spec"]["slos"] == {"ttft_ms": 500, "tpot_ms": None, "e2el_ms": 2000}
    assert exp["runs"][0]["workload"]["arrival"] == "poisson"


@pytest.mark.parametrize(
    ("workload", "needle"),
    [
        ({"arrival": "poisson"}, "needs 'request_rate'"),
        ({"segments": [{"name": "q"}]}, "kind 'template' only"),
        ({"kind": "replay"}, "non-empty list"),
        (
            {
                "kind": "replay",
                "replay": [{"messages": [{"role": "user", "content": "hi"}]}, {"prompt": ""}],
            },
            "prompt",
        ),
        (
            {"kind": "template", "segments": [{"name": "q"}, {"name": "q"}]},
            "duplicate",
        ),
    ],
)
def test_bad_workloads_are_422_naming_the_problem(
    client: TestClient, workload: dict[str, Any], needle: str
) -> None:
    spec = demo_spec()
    spec["baseline"]["workload"] = {"num_requests": 4, **workload}
    resp = client.post("/api/v1/experiments", json=spec)
    assert resp.status_code == 422 and resp.headers["content-type"] == PROBLEM
    text = json.dumps(resp.json())
    assert needle in text, text
    assert "workload" in text


def test_bad_slos_and_ladder_on_template_are_422(client: TestClient) -> None:
    resp = client.post("/api/v1/experiments", json=demo_spec(slos={}))
    assert resp.status_code == 422 and "at least one of" in resp.text
    spec = demo_spec(preset="ladder", variants=[])
    spec["baseline"]["engine_args"] = {"max_model_len": 1024}
    spec["baseline"]["workload"] = {"kind": "template", "num_requests": 4}
    resp = client.post("/api/v1/experiments", json=spec)
    assert resp.status_code == 422 and "include_mix_step" in resp.text


def test_parity_endpoints(client: TestClient, session_factory: sessionmaker[Session]) -> None:
    body = client.post("/api/v1/experiments", json=demo_spec()).json()
    run_id = body["runs"][0]["id"]
    missing = client.get(f"/api/v1/runs/{run_id}/parity")
    assert missing.status_code == 404 and missing.headers["content-type"] == PROBLEM
    assert "not been placed" in missing.json()["detail"]

    report = {"verdict": "blocked", "mismatches": [{"field": "python"}], "nodes": ["a", "b"]}
    with session_factory() as s:
        run = s.get(Run, run_id)
        assert run is not None
        run.parity, run.placement, run.status = report, {"nnodes": 2}, "blocked"
        s.commit()
    got = client.get(f"/api/v1/runs/{run_id}/parity").json()
    assert got["report"] == report and got["placement"] == {"nnodes": 2}
    assert got["status"] == "blocked"

    bad = client.post("/api/v1/cluster/parity", json={"node_ids": [], "colour": "red"})
    assert bad.status_code == 422 and bad.headers["content-type"] == PROBLEM
    assert "colour" in bad.text and "node_ids" in bad.text
    created = client.post(
        "/api/v1/cluster/parity", json={"model": "tiny", "engine_args": {"max_model_len": 1024}}
    )
    assert created.status_code == 202, created.text
    doc = created.json()
    assert doc["status"] == "pending" and created.headers["location"] == doc["url"]
    assert doc["request"]["model_path"].endswith("tiny")
    again = client.get(doc["url"]).json()
    assert again["id"] == doc["id"] and again["report"] is None
    assert client.get("/api/v1/cluster/parity/nope").status_code == 404


def test_parity_request_is_checked_like_a_spec(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    from sqlalchemy import delete

    from orchestrator.core.models import Orchestrator, ParityCheck
    from orchestrator.core.repositories import OrchestratorRepository

    with session_factory() as s:
        before = s.scalar(select(func.count()).select_from(ParityCheck))
        OrchestratorRepository(s).heartbeat(
            "parity-test-orchestrator",
            "host",
            {
                "CPU": 2.0,
                "nodes": [{"node_id": "n1", "ip": "10.0.0.1", "total": 2, "available": 2}],
            },
        )
        s.commit()
    try:
        bad = client.post(
            "/api/v1/cluster/parity",
            json={
                "node_ids": ["n1", "ghost"],
                "engine_args": {"no_such_arg": 1},
                "tensor_parallel_size": 4,
                "model": "no-such-model-dir",
            },
        )
        assert bad.status_code == 422 and bad.headers["content-type"] == PROBLEM
        doc = bad.json()
        assert doc["title"] == "Invalid parity check request"
        text = json.dumps(doc["errors"])
        assert "ghost" in text and "no_such_arg" in text
        assert "tensor_parallel_size 4 needs 4" in text and "model" in text
        with session_factory() as s:
            assert s.scalar(select(func.count()).select_from(ParityCheck)) == before
        ok = client.post("/api/v1/cluster/parity", json={"node_ids": ["n1"]})
        assert ok.status_code == 202, ok.text
    finally:
        with session_factory() as s:
            s.execute(delete(Orchestrator).where(Orchestrator.id == "parity-test-orchestrator"))
            s.commit()
