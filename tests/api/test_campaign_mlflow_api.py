"""``POST /api/v1/campaigns/{id}/export/mlflow`` against a real Postgres and a real local
MLflow store (SQLite), read back with MLflow's ``MlflowClient``: the parent run with the
campaign's runs nested; every refusal is problem+json with a stable code.

The campaign is advanced by the service with **fake recorded results**
(:func:`tests.orchestrator.tuning.test_campaign_service.drive`); a fresh database per
module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from orchestrator.core.db import unit_of_work
from orchestrator.core.models import Campaign
from orchestrator.core.repositories import CampaignRepository
from orchestrator.core.settings import Settings
from orchestrator.tuning.intake import accept_campaign
from tests.api.conftest import settings as settings  # noqa: F401 - fixture
from tests.orchestrator.tuning.test_campaign_service import campaign_doc, drive

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # never report home from tests
pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

PROBLEM = "application/problem+json"


@pytest.fixture
def client(settings: Settings, factory: sessionmaker[Session]) -> Iterator[TestClient]:  # noqa: F811
    with TestClient(create_app(settings, factory)) as c:
        yield c


@pytest.fixture
def ended(factory: sessionmaker[Session], settings: Settings) -> Campaign:  # noqa: F811
    with unit_of_work(factory) as s:
        cid = accept_campaign(s, settings, campaign_doc(name="tune apc api export")).id
    row = drive(factory, settings, cid)
    assert row.status == "succeeded", row.status_reason
    return row


def test_export_to_a_local_store_when_allowed(
    client: TestClient,
    settings: Settings,  # noqa: F811
    factory: sessionmaker[Session],
    ended: Campaign,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # a SQLite store keeps artifacts under the working directory
    settings.mlflow.allow_local_stores = True
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    url = f"/api/v1/campaigns/{ended.id}/export/mlflow"
    with factory() as s:
        n_runs = len(CampaignRepository(s).runs(ended.id))

    resp = client.post(url, json={"tracking_uri": uri, "experiment_name": "campaign-api"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["campaign_id"] == ended.id
    assert body["mlflow_experiment_name"] == "campaign-api"
    assert body["parent_action"] == "created" and body["parent_run_id"]
    assert body["params"] > 0 and body["metrics"] > 0
    assert body["nested"] == n_runs
    assert sum(len(c["runs"]) for c in body["cycles"]) == n_runs
    assert {r["action"] for c in body["cycles"] for r in c["runs"]} == {"created"}

    ml = MlflowClient(tracking_uri=uri)
    parent = ml.get_run(body["parent_run_id"])
    assert parent.data.tags["vlab.kind"] == "campaign"
    assert parent.data.tags["vlab.campaign_id"] == ended.id
    # the campaign's page on the dashboard, at the address the caller used
    assert parent.data.tags["vlab.campaign_url"] == f"http://testserver/campaigns/{ended.id}"
    children = ml.search_runs(
        [body["mlflow_experiment_id"]],
        filter_string=f"tags.`mlflow.parentRunId` = '{body['parent_run_id']}'",
        max_results=1000,
    )
    assert len(children) == n_runs

    again = client.post(url, json={"tracking_uri": uri, "experiment_name": "campaign-api"})
    assert again.status_code == 200, again.text
    second = again.json()
    assert second["parent_action"] == "unchanged"
    assert second["parent_run_id"] == body["parent_run_id"]
    assert {r["action"] for c in second["cycles"] for r in c["runs"]} == {"unchanged"}
    assert len(ml.search_runs([body["mlflow_experiment_id"]], max_results=1000)) == n_runs + 1


def test_refusals_are_problems_with_stable_codes(client: TestClient, tmp_path: Path) -> None:
    resp = client.post(
        "/api/v1/campaigns/no-such-campaign/export/mlflow",
        json={"tracking_uri": "http://127.0.0.1:9"},
    )
    assert resp.status_code == 404, resp.text
    assert resp.headers["content-type"].startswith(PROBLEM)
    assert resp.json()["code"] == "campaign_not_found"

    cid = client.post("/api/v1/campaigns", json=campaign_doc(name="queued")).json()["id"]
    url = f"/api/v1/campaigns/{cid}/export/mlflow"
    target = tmp_path / "target"
    target.mkdir()
    # the API writes nothing on the service's own disk unless an administrator allows it
    for uri in (f"file://{target}/mlruns", f"sqlite:///{target}/m.db"):
        resp = client.post(url, json={"tracking_uri": uri})
        assert resp.status_code == 422, resp.text
        assert resp.headers["content-type"].startswith(PROBLEM)
        assert resp.json()["code"] == "export_request_invalid"
        assert resp.json()["errors"][0]["loc"] == ["body", "tracking_uri"]
    assert not list(target.iterdir())
    resp = client.post(url, json={"tracking_uri": "https://x.example", "include_failed": True})
    assert resp.status_code == 422 and resp.json()["code"] == "request_invalid"


def test_openapi_declares_the_export_answers(client: TestClient) -> None:
    op = client.get("/openapi.json").json()["paths"][
        "/api/v1/campaigns/{campaign_id}/export/mlflow"
    ]["post"]
    assert {"200", "404", "409", "422", "501", "502"} <= set(op["responses"])
    for code in ("404", "409", "501", "502"):
        assert list(op["responses"][code]["content"]) == [PROBLEM]
