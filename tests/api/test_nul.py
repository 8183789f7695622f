"""NUL characters (which Postgres text cannot hold) are refused as 422 problems, never a
500 with the SQL in it (found by a new-user trial)."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from tests.api.test_api import PROBLEM, demo_spec


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/runs?model=%00",
        "/api/v1/runs?engine_arg=a%00=1",
        "/api/v1/runs/%00",
        "/api/v1/experiments/%00",
        "/api/v1/schedules/%00",
        "/?experiment=%00",
        "/runs/%00",
        "/compare?run=%00",
    ],
)
def test_nul_in_the_url(client: TestClient, url: str) -> None:
    resp = client.get(url)
    assert resp.status_code == 422 and resp.headers["content-type"] == PROBLEM
    assert resp.json()["code"] == "nul_character"


def test_nul_in_a_json_body_is_not_stored(client: TestClient) -> None:
    name = f"nul-{uuid.uuid4().hex[:6]}"
    body = {"name": name + "\u0000x", "cron": "0 9 * * *", "template": demo_spec()}
    resp = client.post("/api/v1/schedules", json=body)
    assert resp.status_code == 422 and resp.headers["content-type"] == PROBLEM
    assert "SELECT" not in resp.text and "INSERT" not in resp.text
    listed = client.get("/api/v1/schedules", params={"limit": 500}).json()["items"]
    assert not any(s["name"].startswith(name) for s in listed)
    # the engine_arg value as JSON with an escaped NUL reaches the JSONB filter
    resp = client.get("/api/v1/runs", params={"engine_arg": 'max_num_seqs="\\u0000"'})
    assert resp.status_code == 422 and "NUL" in resp.json()["detail"]
