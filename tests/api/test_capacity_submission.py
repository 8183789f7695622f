"""Capacity at submission through the REST API: the search's time bound where the spec is
accepted, and a spec whose steps cannot reach a steady state refused with the reason.

The rules themselves are tested in ``tests/orchestrator/experiments/test_spec.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from orchestrator.cli import common as cli
from tests.api.test_capacity_api import PROBLEM, capacity_spec


def test_the_accepted_spec_says_how_long_the_search_can_take(client: TestClient) -> None:
    doc = capacity_spec(min=2, max_steps=8, max_step_s=60, max_drain_s=15)
    resp = client.post("/api/v1/experiments", json=doc)
    assert resp.status_code == 201, resp.text
    bound = resp.json()["capacity_estimate"]
    assert bound["runs"] == 2  # baseline and apc-on, one repeat
    # 8 steps of 60 s and 15 s of drain, and the load generator's calibration (10 s)
    assert bound["run_s_max"] == 8 * (60 + 15) + 10 and bound["experiment_s_max"] == 2 * 610
    assert bound["calibration_s_max"] == 10
    assert "at most 8 steps" in bound["note"]
    # the stored spec keeps it beside the spec the user sent (a variant added later is
    # checked against the user's spec, not against the estimate)
    exp = client.get(f"/api/v1/experiments/{resp.json()['id']}").json()
    assert exp["spec"]["capacity_estimate"] == bound
    assert exp["spec"]["capacity"]["max_step_s"] == 60


def test_steps_that_cannot_reach_a_steady_state_are_422(client: TestClient) -> None:
    # at min 0.5 req/s a step's 64 requests (the fewest a steady state needs) take 126 s
    resp = client.post("/api/v1/experiments", json=capacity_spec(max_step_s=60))
    assert resp.status_code == 422, resp.text
    assert resp.headers["content-type"].startswith(PROBLEM)
    (err,) = resp.json()["errors"]
    assert err["loc"] == ["body", "capacity", "max_step_s"]
    assert err["type"] == "capacity_no_steady_state"
    assert "over max_step_s (60 s)" in err["msg"]
    resp = client.post("/api/v1/experiments", json=capacity_spec(min_step_s=90, max_step_s=60))
    assert resp.status_code == 422 and "max_step_s" in resp.text


def test_vlab_submit_prints_the_bound(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def through_app(method: str, url: str, **kw: Any) -> Any:
        return client.request(method, url.removeprefix("http://api"), json=kw.get("json"))

    monkeypatch.setattr(cli, "http_call", through_app)
    doc = capacity_spec(min=2, max_steps=8, max_step_s=60, max_drain_s=15)
    assert cli.submit_spec("http://api", doc) is not None
    out = capsys.readouterr().out
    assert "capacity search: at most 20 min of load in all (at most 8 steps" in out
