"""Submission rules for GPU clusters: the Ray executor, reserved engine arguments, model ids.

No orchestrator publishes a heartbeat here, so the device kind in force is CPU
(``device_resource: auto`` with no cluster seen).
"""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.models import Experiment
from tests.api.test_api import demo_spec


def _layout(**layout: Any) -> dict[str, Any]:
    spec = demo_spec()
    spec["baseline"]["layout"] = layout
    return spec


def test_ray_executor_on_a_cpu_cluster_is_refused_at_submission(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    with session_factory() as s:
        before = s.scalar(select(func.count()).select_from(Experiment))
    resp = client.post("/api/v1/experiments", json=_layout(executor="ray"))
    assert resp.status_code == 422, resp.text
    errors = resp.json()["errors"]
    assert {e["type"] for e in errors} == {"executor_unsupported"}
    assert all("current platform cpu does not support ray" in e["msg"] for e in errors)
    assert [e["loc"] for e in errors] == [["body", "baseline", "layout", "executor"]] * 2
    # a variant that switches to the Ray executor is named where it does so
    spec = demo_spec(
        variants=[{"name": "ray", "changes": {"layout.executor": "ray"}}],
    )
    resp = client.post("/api/v1/experiments", json=spec)
    assert resp.status_code == 422, resp.text
    assert [e["loc"] for e in resp.json()["errors"]] == [
        ["body", "variants", 0, "changes", "layout.executor"]
    ]
    with session_factory() as s:
        assert s.scalar(select(func.count()).select_from(Experiment)) == before


def test_unknown_executor_is_a_field_error(client: TestClient) -> None:
    resp = client.post("/api/v1/experiments", json=_layout(executor="nccl"))
    assert resp.status_code == 422
    locs = [e["loc"] for e in resp.json()["errors"]]
    assert ["body", "baseline", "layout", "executor"] in locs


def test_revision_and_executor_backend_are_not_engine_args(client: TestClient) -> None:
    spec = demo_spec()
    spec["baseline"]["engine_args"].update(
        {"revision": "main", "distributed_executor_backend": "ray"}
    )
    resp = client.post("/api/v1/experiments", json=spec)
    assert resp.status_code == 422
    msgs = {e["loc"][-1]: e["msg"] for e in resp.json()["errors"]}
    assert (
        "revision" in msgs["revision"] and "layout.executor" in msgs["distributed_executor_backend"]
    )


def test_model_id_that_no_node_can_resolve_is_422_with_the_answer(client: TestClient) -> None:
    resp = client.post("/api/v1/experiments", json=demo_spec(model="acme/not-here"))
    assert resp.status_code == 422
    (err,) = resp.json()["errors"]
    assert err["loc"] == ["body", "model"] and err["type"] == "unknown_model"
    assert "acme/not-here" in err["msg"] and "could not be resolved" in err["msg"]


def test_bad_revision_is_a_field_error(client: TestClient) -> None:
    resp = client.post("/api/v1/experiments", json=demo_spec(revision="../etc"))
    assert resp.status_code == 422
    assert ["body", "revision"] in [e["loc"] for e in resp.json()["errors"]]


def test_revision_of_a_generated_model_or_directory_is_refused(client: TestClient) -> None:
    resp = client.post("/api/v1/experiments", json=demo_spec(revision="main"))
    assert resp.status_code == 422
    (err,) = resp.json()["errors"]
    assert err["loc"] == ["body", "model"] and "applies to a model named by" in err["msg"]
