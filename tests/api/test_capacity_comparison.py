"""``GET /api/v1/experiments/{id}/comparison``: the per-variant ``capacity`` member, built
from the stored runs' capacity searches (``runs.capacity``) of succeeded repeats."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.models import Experiment, Run
from tests.api.test_api import _finish, demo_spec


def _doc(
    capacity: float | None,
    lo: float | None,
    hi: float | None,
    status: str = "found",
    binding: str | None = "ttft_ms p99",
) -> dict[str, Any]:
    return {
        "variable": "request_rate",
        "status": status,
        "capacity": capacity,
        "interval": [lo, hi],
        "binding_slo": binding,
        "steps": [],
        "note": None,
    }


def _store(
    session_factory: sessionmaker[Session],
    run_id: str,
    capacity: dict[str, Any] | None,
    layout: dict[str, Any] | None = None,
) -> None:
    with session_factory() as s:
        run = s.get(Run, run_id)
        assert run is not None
        run.capacity = capacity
        if layout is not None:
            run.layout = layout
        s.commit()


def _submit_and_finish(
    client: TestClient, session_factory: sessionmaker[Session]
) -> dict[str, Any]:
    body = client.post("/api/v1/experiments", json=demo_spec(repeats=2)).json()
    for r in body["runs"]:
        _finish(session_factory, r["id"], 0.2 if r["name"] == "baseline" else 0.05)
    return body


def _variant(client: TestClient, experiment_id: str) -> dict[str, Any]:
    resp = client.get(f"/api/v1/experiments/{experiment_id}/comparison")
    assert resp.status_code == 200, resp.text
    (variant,) = resp.json()["variants"]
    return variant


def test_no_capacity_spec_no_capacity_member(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    body = _submit_and_finish(client, session_factory)
    variant = _variant(client, body["id"])
    assert variant["capacity"] is None
    assert variant["metrics"]  # the comparison is unchanged otherwise


def test_capacity_ratio_interval_verdict_and_per_device(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    body = _submit_and_finish(client, session_factory)
    two = {"tensor_parallel_size": 2, "pipeline_parallel_size": 1}
    one = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    caps = {
        ("baseline", 0): _doc(4.0, 4.0, 4.2),
        ("baseline", 1): _doc(4.4, 4.4, 4.6),
        ("apc-on", 0): _doc(9.0, 9.0, 9.4, binding="tpot_ms p99"),
        ("apc-on", 1): _doc(9.4, 9.4, 9.8, binding="tpot_ms p99"),
    }
    for r in body["runs"]:
        layout = two if r["name"] == "apc-on" else one
        _store(session_factory, r["id"], caps[(r["name"], r["repeat_index"])], layout)
    cap = _variant(client, body["id"])["capacity"]
    assert cap["verdict"] == "higher" and cap["reason"] is None
    assert cap["variable"] == "request_rate" and cap["unit"] == "requests/s"
    assert abs(cap["reference_capacity"] - 4.2) < 1e-9 and abs(cap["capacity"] - 9.2) < 1e-9
    assert abs(cap["ratio"] - 9.2 / 4.2) < 1e-9
    # the envelope of the repeats' brackets: lowest variant low / highest reference high
    assert abs(cap["ci_low"] - 9.0 / 4.6) < 1e-9 and abs(cap["ci_high"] - 9.8 / 4.0) < 1e-9
    assert cap["found"] == {"reference": 2, "variant": 2}
    assert cap["devices"] == {"reference": 1, "variant": 2}
    assert abs(cap["per_device_ratio"] - 9.2 / 2 / 4.2) < 1e-9
    # per device the envelope reaches under 1 (4.5 / 4.6): no clear change
    assert cap["per_device_verdict"] == "no_change"
    assert cap["binding_slo"] == {"reference": "ttft_ms p99", "variant": "tpot_ms p99"}


def test_capacity_unknown_until_both_sides_found(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    body = _submit_and_finish(client, session_factory)
    with session_factory() as s:
        exp = s.get(Experiment, body["id"])
        assert exp is not None
        exp.spec = {
            **exp.spec,
            "capacity": {"slos": {"ttft_ms": {"p99": 500}}, "min": 1, "max": 16},
        }
        s.commit()
    # the spec asks for capacity, nothing searched yet: unknown, with the reason
    cap = _variant(client, body["id"])["capacity"]
    assert cap["verdict"] == "unknown" and cap["ratio"] is None
    assert cap["reason"] == (
        "reference: no succeeded run with a capacity search; "
        "variant: no succeeded run with a capacity search"
    )
    for r in body["runs"]:
        doc = (
            _doc(None, None, None, status="uncertain")
            if r["name"] == "baseline"
            else _doc(9.0, 9.0, 9.4)
        )
        _store(session_factory, r["id"], doc)
    cap = _variant(client, body["id"])["capacity"]
    assert cap["verdict"] == "unknown" and cap["reason"] == "reference: uncertain"
    assert cap["capacity"] == 9.0 and cap["reference_capacity"] is None
