"""``GET /api/v1/runs/{id}/findings`` and ``/experiments/{id}/findings`` on real run data."""

from __future__ import annotations

import uuid

from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.models import Run
from tests.web.seed import DATA, load_export


def test_findings_of_a_real_experiment(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    with session_factory.begin() as s:
        ids = load_export(s, DATA / "demo_experiment.json", name=f"findings-{uuid.uuid4().hex[:6]}")
    exp_id = ids["experiment_id"]
    # the real demo: APC on hits ~90 %, TTFT clearly better: nothing to advise
    body = client.get(f"/api/v1/experiments/{exp_id}/findings").json()
    assert body == {"experiment_id": exp_id, "findings": []}

    # the same apc-on run with a hit rate near 0 -> prefix caching without effect
    apc = ids["runs"]["apc-on#0"]
    with session_factory.begin() as s:
        from orchestrator.core.models import RunMetric

        s.get(RunMetric, (apc, "prefix_cache_hit_rate")).value = 0.01  # type: ignore[union-attr]
    found = client.get(f"/api/v1/runs/{apc}/findings").json()["findings"]
    assert [f["code"] for f in found] == ["prefix_caching_no_effect"]
    assert found[0]["run_id"] == apc and found[0]["evidence"]["measured_hit_rate"] == 0.01
    exp_found = client.get(f"/api/v1/experiments/{exp_id}/findings").json()["findings"]
    assert {(f["code"], f["variant"]) for f in exp_found} >= {
        ("prefix_caching_no_effect", "apc-on")
    }
    with session_factory() as s:
        assert s.scalar(select(Run.status).where(Run.id == apc)) == "succeeded"


def test_unknown_ids_are_404(client: TestClient) -> None:
    assert client.get("/api/v1/runs/nope/findings").status_code == 404
    assert client.get("/api/v1/experiments/nope/findings").status_code == 404
