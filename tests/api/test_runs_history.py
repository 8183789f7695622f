"""``GET /api/v1/runs`` as the run history: filters, sorting, pagination, bad input."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.runs.history import HistoryQueryError, parse_engine_arg
from tests.api.test_api import PROBLEM
from tests.factories import make_experiment
from tests.web.seed import bulk_history


@pytest.fixture
def model(session_factory: sessionmaker[Session]) -> Iterator[str]:
    """12 runs (3 experiments x 4) under a model name no other test uses."""
    name = f"hist-{uuid.uuid4().hex[:8]}"
    with session_factory.begin() as s:
        bulk_history(
            s,
            experiments=3,
            runs_per_experiment=4,
            model=name,
            start=datetime(2026, 3, 1, tzinfo=UTC),
            name_prefix=name,
        )
    yield name


def test_parse_engine_arg() -> None:
    assert parse_engine_arg("enable_prefix_caching=true") == ("enable_prefix_caching", True)
    assert parse_engine_arg("--max-num-seqs=64") == ("max_num_seqs", 64)
    assert parse_engine_arg("kv_cache_dtype=fp8") == ("kv_cache_dtype", "fp8")
    with pytest.raises(HistoryQueryError, match="name=value"):
        parse_engine_arg("enable_prefix_caching")


def test_filter_by_model_engine_argument_and_status(client: TestClient, model: str) -> None:
    page = client.get("/api/v1/runs", params={"model": model}).json()
    assert page["total"] == 12
    apc = client.get(
        "/api/v1/runs", params={"model": model, "engine_arg": "enable_prefix_caching=true"}
    ).json()
    assert apc["total"] == 6
    assert all(r["engine_args"]["enable_prefix_caching"] is True for r in apc["items"])
    failed = client.get("/api/v1/runs", params={"model": model, "status": "failed"}).json()
    # run k = 4e + i failed when k % 7 == 6: k = 6 only (k < 12)
    assert [(r["name"], r["status"]) for r in failed["items"]] == [("v2", "failed")]


def test_sort_by_metric_and_paginate(client: TestClient, model: str) -> None:
    asc = client.get(
        "/api/v1/runs", params={"model": model, "sort": "ttft_p50", "order": "asc", "limit": 5}
    ).json()
    values = [r["metrics"]["median_ttft_ms"] for r in asc["items"]]
    assert values == sorted(values) and values[0] == 10.0 and len(values) == 5
    rest = client.get(
        "/api/v1/runs",
        params={"model": model, "sort": "ttft_p50", "order": "asc", "limit": 5, "offset": 5},
    ).json()
    assert rest["items"][0]["metrics"]["median_ttft_ms"] >= values[-1]
    assert {r["id"] for r in rest["items"]}.isdisjoint({r["id"] for r in asc["items"]})


def test_date_range_and_experiment_name(client: TestClient, model: str) -> None:
    # experiments are submitted one minute apart from 2026-03-01T00:00Z
    page = client.get(
        "/api/v1/runs",
        params={"model": model, "since": "2026-03-01T00:01:00Z", "until": "2026-03-01T00:02:00Z"},
    ).json()
    assert page["total"] == 4
    assert {r["experiment_id"] for r in page["items"]} == {page["items"][0]["experiment_id"]}
    named = client.get("/api/v1/runs", params={"experiment": f"{model}-00002"}).json()
    assert named["total"] == 4


def test_bad_sort_and_engine_arg_are_problems(client: TestClient) -> None:
    resp = client.get("/api/v1/runs", params={"sort": "nope"})
    assert resp.status_code == 422 and resp.headers["content-type"] == PROBLEM
    assert resp.json()["errors"][0]["loc"] == ["query", "sort"]
    resp = client.get("/api/v1/runs", params={"since": "2026-03-02", "until": "2026-03-01"})
    assert resp.status_code == 422 and resp.json()["errors"][0]["loc"] == ["query", "until"]
    resp = client.get("/api/v1/runs", params={"engine_arg": "oops"})
    assert resp.status_code == 422 and "name=value" in resp.json()["detail"]


def test_the_dashboard_table_renders_from_brief_rows(
    client: TestClient, model: str, session_factory: sessionmaker[Session]
) -> None:
    """The history page loads only the table's columns and metrics
    (``history_page(brief=True)``); every cell it shows still comes through."""
    html = client.get("/", params={"model": model}).text
    assert html.count("<tr data-run-id=") == 12
    assert f"{model}-00002" in html and ">v3</a>" in html  # experiment and run names
    assert ">10.0</td>" in html and ">50.0 %</td>" in html  # TTFT p50 and hit rate
    assert ">(baseline)</td>" in html and "enable_prefix_caching = true" in html

    other = f"apc-{uuid.uuid4().hex[:8]}"
    with session_factory.begin() as s:  # no metrics yet: prefix caching off shows "off"
        make_experiment(s, n_runs=2, model_id=other)
    html = client.get("/", params={"model": other}).text
    assert html.count("<tr data-run-id=") == 2
    assert html.count('title="prefix caching off') == 1
