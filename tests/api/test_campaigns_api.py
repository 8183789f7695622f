"""``/api/v1/campaigns``: start, list, read and cancel tuning campaigns over HTTP.

Runs are advanced by the service (:func:`orchestrator.tuning.service.advance`, what the
dispatcher's ``campaigns`` loop calls) and their results are **fake recorded results**
(``record_fake_result``: the objective written as the run's stored metric). A fresh
database per module.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from orchestrator.core import auth
from orchestrator.core.db import unit_of_work
from orchestrator.core.models import ApiToken, AuditEvent, WebSession
from orchestrator.core.settings import Settings
from orchestrator.tuning import service
from tests.api.conftest import settings as settings  # noqa: F401 - fixture
from tests.orchestrator.tuning.test_campaign_service import campaign_doc, finish_queued

PROBLEM = "application/problem+json"


@pytest.fixture
def client(settings: Settings, factory: sessionmaker[Session]) -> Iterator[TestClient]:  # noqa: F811
    with TestClient(create_app(settings, factory)) as c:
        yield c


def advance(factory: sessionmaker[Session], settings: Settings, cid: str) -> None:  # noqa: F811
    with unit_of_work(factory) as s:
        service.advance(s, settings, cid)


def test_post_stores_a_queued_campaign(client: TestClient) -> None:
    resp = client.post("/api/v1/campaigns", json=campaign_doc())
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["status"] == "queued" and body["name"] == "tune apc"
    assert body["url"].endswith(f"/api/v1/campaigns/{body['id']}")
    assert body["request"]["objective"] == {"metric": "output_throughput", "direction": "higher"}
    assert body["runs"] == [] and body["path"] == [] and body["confirmation"] is None
    assert body["submitted_by"] == "anonymous"
    assert client.get(body["url"]).json()["id"] == body["id"]
    slo = {"metric": "p99_ttft_ms", "max": 500.0}
    resp = client.post("/api/v1/campaigns", json=campaign_doc(name="slo", constraints=[slo]))
    assert resp.status_code == 201, resp.text
    assert resp.json()["request"]["constraints"] == [{**slo, "min": None}]
    for wrong, loc in (
        ({"metric": "p99_ttft_ms"}, ["body", "constraints", 0]),
        ({"metric": "ttft", "max": 1}, ["body", "constraints", 0, "metric"]),
    ):
        resp = client.post("/api/v1/campaigns", json=campaign_doc(constraints=[wrong]))
        assert resp.status_code == 422 and resp.headers["content-type"].startswith(PROBLEM)
        assert any(e["loc"][: len(loc)] == loc for e in resp.json()["errors"]), resp.text


def test_bad_campaigns_are_422_problems_with_field_errors(client: TestClient) -> None:
    bad = campaign_doc(
        space=[{"name": "engine_args.max_num_seq", "levels": [1, 2], "start": 1}],
        budget={"max_runs": 5},
    )
    resp = client.post("/api/v1/campaigns", json=bad)
    assert resp.status_code == 422 and resp.headers["content-type"].startswith(PROBLEM)
    problem = resp.json()
    assert problem["code"] == "campaign_invalid"
    locs = [e["loc"] for e in problem["errors"]]
    assert ["body", "space", 0, "levels", 0] in locs
    assert ["body", "budget", "max_runs"] in locs
    # the schema's own problems: the framework's 422, fields named too
    resp = client.post("/api/v1/campaigns", json={**campaign_doc(), "space": "x"})
    assert resp.status_code == 422 and resp.headers["content-type"].startswith(PROBLEM)
    assert any(e["loc"][:2] == ["body", "space"] for e in resp.json()["errors"])
    assert client.get("/api/v1/campaigns", params={"limit": 500}).json()["total"] == len(
        client.get("/api/v1/campaigns", params={"limit": 500}).json()["items"]
    )


def test_a_campaign_read_back_with_path_candidates_confirmation_and_runs(
    client: TestClient,
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = client.post("/api/v1/campaigns", json=campaign_doc()).json()["id"]
    advance(factory, settings, cid)
    body = client.get(f"/api/v1/campaigns/{cid}").json()
    assert body["status"] == "running" and body["phase"] == "rounds"
    assert body["slots"] == 1  # no orchestrator reports GPUs here: interleaved
    assert [r["label"] for r in body["runs"]][0] == "r1.c1.incumbent"
    assert all(r["status"] == "queued" and "/api/v1/runs/" in r["url"] for r in body["runs"])
    run = client.get(body["runs"][1]["url"]).json()  # a run links back to its campaign
    assert run["campaign_id"] == cid
    assert run["campaign_label"] == "r1.c1.engine_args.enable_prefix_caching=true"
    assert run["submitted_by"] == "campaign:tune apc"
    assert {c["outcome"] for c in body["candidates"]} == {"measuring"}
    for _ in range(100):
        finish_queued(factory, cid)
        advance(factory, settings, cid)
        body = client.get(f"/api/v1/campaigns/{cid}").json()
        if body["status"] != "running":
            break
    assert body["status"] == "succeeded", body["status_reason"]
    (adopted,) = body["path"]
    assert adopted["variable"] == "engine_args.enable_prefix_caching"
    assert adopted["to_level"] is True and adopted["gain"]["relative"] > 0.2
    assert adopted["effect"].startswith("+")
    verdicts = {(c["round"], c["label"]): c for c in body["candidates"]}
    first = verdicts[(1, "engine_args.enable_prefix_caching=true")]
    assert first["outcome"] == "adopted" and first["verdict"] == "pays" and first["pairs"] >= 2
    assert verdicts[(1, "engine_args.max_num_seqs=64")]["outcome"] == "worse"
    assert body["confirmation"]["agrees"] is True
    assert body["confirmation"]["total"]["relative_low"] > 0
    assert body["cumulative"]["n"] >= 2
    assert body["incumbent"]["engine_args.enable_prefix_caching"] is True
    assert len(body["runs"]) == body["runs_used"]

    page = client.get("/api/v1/campaigns", params={"limit": 1}).json()
    assert page["limit"] == 1 and page["offset"] == 0 and page["total"] >= 1
    (item,) = page["items"]
    assert item["id"] == cid and item["objective"] == "output_throughput"
    assert item["run_count"] == body["runs_used"] and item["status"] == "succeeded"

    resp = client.post(f"/api/v1/campaigns/{cid}/cancel")
    assert resp.status_code == 409 and resp.json()["code"] == "campaign_already_ended"


def test_cancel_over_http(
    client: TestClient,
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = client.post("/api/v1/campaigns", json=campaign_doc()).json()["id"]
    advance(factory, settings, cid)
    resp = client.post(f"/api/v1/campaigns/{cid}/cancel")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["status"] == "cancelled"
    assert {r["status"] for r in body["runs"]} == {"cancelled"}
    run = client.get(body["runs"][0]["url"]).json()
    assert run["status"] == "cancelled" and run["cancelled_by"] == "anonymous"


def test_unknown_campaign_is_404(client: TestClient) -> None:
    for resp in (
        client.get("/api/v1/campaigns/nope"),
        client.post("/api/v1/campaigns/nope/cancel"),
    ):
        assert resp.status_code == 404 and resp.json()["code"] == "campaign_not_found"


def test_roles_as_for_experiments(client: TestClient, factory: sessionmaker[Session]) -> None:
    """Viewers read campaigns; starting and cancelling need an operator."""

    def token(role: str) -> dict[str, str]:
        with factory.begin() as s:
            _, secret = auth.create_token(s, name=f"campaign-{role}", role=role, created_by="test")
        return {"Authorization": f"Bearer {secret}"}

    viewer, operator = token("viewer"), token("operator")
    try:
        assert client.get("/api/v1/campaigns", headers=viewer).status_code == 200
        resp = client.post("/api/v1/campaigns", json=campaign_doc(), headers=viewer)
        assert resp.status_code == 403 and resp.json()["required_role"] == "operator"
        resp = client.post("/api/v1/campaigns", json=campaign_doc(), headers=operator)
        assert resp.status_code == 201 and resp.json()["submitted_by"] == "campaign-operator"
        cid = resp.json()["id"]
        assert client.get(f"/api/v1/campaigns/{cid}", headers=viewer).status_code == 200
        resp = client.post(f"/api/v1/campaigns/{cid}/cancel", headers=viewer)
        assert resp.status_code == 403
        resp = client.post(f"/api/v1/campaigns/{cid}/cancel", headers=operator)
        assert resp.status_code == 200
        assert client.get("/api/v1/campaigns").status_code == 401  # tokens exist: no open access
    finally:  # back to open access for the other tests
        with factory.begin() as s:
            s.execute(delete(WebSession))
            s.execute(delete(ApiToken))
            s.execute(delete(AuditEvent))


def test_the_final_configuration_and_the_wall_time_are_described_and_shown(
    client: TestClient,
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    fields = schemas["CampaignOut"]["properties"]
    assert {"serve_command", "spec", "wall_time", "retried", "unmeasured"} <= set(fields)
    assert {"type": "string"} in fields["serve_command"]["anyOf"]
    assert {"type": "object", "additionalProperties": True} in fields["spec"]["anyOf"]
    wall = schemas["CampaignWallTimeOut"]["properties"]
    assert {"elapsed_s", "queue_wait_s", "startup_s", "measure_s", "server_starts"} <= set(wall)

    cid = client.post("/api/v1/campaigns", json=campaign_doc()).json()["id"]
    body = client.get(f"/api/v1/campaigns/{cid}").json()
    assert body["serve_command"] is None and body["spec"] is None and body["wall_time"] is None
    advance(factory, settings, cid)
    body = client.get(f"/api/v1/campaigns/{cid}").json()
    assert body["serve_command"].startswith("vllm serve tiny ")
    assert "--max-num-seqs 128" in body["serve_command"]
    assert body["spec"]["baseline"]["engine_args"]["max_num_seqs"] == 128
    assert body["spec"]["repeats"] == 3
    wall = body["wall_time"]
    assert wall["server_starts"] == 0 and wall["startup_s"] == 0.0  # nothing ran yet
    assert wall["elapsed_s"] >= 0 and wall["queue_wait_s"] >= 0
    assert body["retried"] == {} and body["unmeasured"] == {}


def test_the_list_filters_by_status_and_refuses_another(client: TestClient) -> None:
    """``?status=`` keeps the campaigns in that status; a status campaigns never have is a
    422 (a trial saw ``?status=bogus`` answer every campaign); the filter's values are the
    repository's statuses."""
    from typing import get_args

    from api.routes.campaigns import CampaignStatus
    from orchestrator.core.repositories.campaigns import ADVANCING, ENDED

    assert set(get_args(CampaignStatus)) == {*ADVANCING, *ENDED}
    assert client.post("/api/v1/campaigns", json=campaign_doc(name="filtered")).status_code == 201
    queued = client.get("/api/v1/campaigns", params={"status": "queued", "limit": 500}).json()
    assert queued["items"] and {c["status"] for c in queued["items"]} == {"queued"}
    done = client.get("/api/v1/campaigns", params={"status": "succeeded", "limit": 500}).json()
    assert all(c["status"] == "succeeded" for c in done["items"])
    assert queued["total"] + done["total"] <= client.get("/api/v1/campaigns").json()["total"]
    bad = client.get("/api/v1/campaigns", params={"status": "bogus"})
    assert bad.status_code == 422 and bad.headers["content-type"].startswith(PROBLEM)
