"""``GET /api/v1/runs`` as the run history: filters, sorting, pagination (offset and keyset
cursor), estimated counts, the default grouped order, the sort keys kept on the run,
bad input."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert, text
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.models import RunMetric
from orchestrator.core.repositories import ExperimentRepository, HistoryRepository, RunRepository
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


def _follow(client: TestClient, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Every item of the list, page after page by its ``next`` URL."""
    body = client.get("/api/v1/runs", params=params).json()
    items = list(body["items"])
    pages = 1
    while body["next"]:
        assert body["next_cursor"] and "cursor=" in body["next"]
        body = client.get(body["next"]).json()
        items += body["items"]
        pages += 1
        assert pages < 50
    return items


@pytest.mark.parametrize(
    ("sort", "order"),
    [
        (None, None),
        ("ttft_p50", "asc"),
        ("ttft_p50", "desc"),
        ("started", "desc"),
        ("status", "asc"),
        ("experiment", "desc"),
        ("duration", "asc"),
        ("variable", "desc"),
    ],
)
def test_cursor_pages_return_every_run_once_in_order(
    client: TestClient,
    model: str,
    session_factory: sessionmaker[Session],
    sort: str | None,
    order: str | None,
) -> None:
    """Keyset pages (``next``) give the same runs in the same order as one big page,
    each once, across the rows with and without the sort value (NULLs last)."""
    with session_factory.begin() as s:  # two runs of the model without metrics or start
        make_experiment(s, n_runs=2, model_id=model)
    params: dict[str, Any] = {"model": model, "limit": 5}
    if sort:
        params |= {"sort": sort, "order": order}
    paged = _follow(client, params)
    whole = client.get("/api/v1/runs", params={**params, "limit": 100}).json()["items"]
    assert len(whole) == 14
    assert [r["id"] for r in paged] == [r["id"] for r in whole]
    if sort == "ttft_p50":
        values = [r["metrics"]["median_ttft_ms"] for r in paged[:12]]
        assert values == sorted(values, reverse=order == "desc")
        assert [r["metrics"] for r in paged[12:]] == [None, None]  # no value: last
    # offset pages agree with the cursor pages
    third = client.get("/api/v1/runs", params={**params, "offset": 10}).json()["items"]
    assert [r["id"] for r in third] == [r["id"] for r in whole[10:]]


def test_a_cursor_of_another_sort_is_a_problem(client: TestClient, model: str) -> None:
    body = client.get("/api/v1/runs", params={"model": model, "limit": 5}).json()
    resp = client.get(
        "/api/v1/runs", params={"model": model, "sort": "ttft_p50", "cursor": body["next_cursor"]}
    )
    assert resp.status_code == 422 and resp.json()["errors"][0]["loc"] == ["query", "cursor"]
    resp = client.get("/api/v1/runs", params={"cursor": "not-a-cursor"})
    assert resp.status_code == 422
    html = client.get("/", params={"cursor": "not-a-cursor"})
    assert html.status_code == 422 and "cursor is not one" in html.text


def test_the_count_is_labelled_estimated_above_the_exact_bound(
    client: TestClient,
    model: str,
    monkeypatch: pytest.MonkeyPatch,
    session_factory: sessionmaker[Session],
) -> None:
    with session_factory.begin() as s:  # statistics to estimate from
        s.execute(text("ANALYZE runs"))
    exact = client.get("/api/v1/runs", params={"model": model}).json()
    assert exact["total"] == 12 and exact["total_estimated"] is False
    assert ">12 runs</span>" in client.get("/", params={"model": model}).text
    monkeypatch.setattr(HistoryRepository, "EXACT_COUNT_UP_TO", 5)
    guess = client.get("/api/v1/runs", params={"model": model}).json()
    assert guess["total_estimated"] is True and guess["total"] >= 6
    html = client.get("/", params={"model": model}).text
    assert "data-estimated>about " in html
    small = client.get("/api/v1/runs", params={"model": model, "status": "failed"}).json()
    assert small["total"] == 1 and small["total_estimated"] is False


def test_history_groups_an_experiments_runs_in_start_order(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    """The default order: the newest experiment first, each experiment's runs together
    in start order, even a variant added after a newer experiment was submitted."""
    tag = f"grp-{uuid.uuid4().hex[:8]}"
    t0 = datetime(2026, 4, 1, tzinfo=UTC)
    with session_factory.begin() as s:
        old = make_experiment(s, n_runs=3, model_id=tag)
        new = make_experiment(s, n_runs=2, model_id=tag)
        old.created_at, new.created_at = t0, t0 + timedelta(hours=1)
        for run in old.runs:  # the third run: a variant added two hours later
            run.created_at = t0 + timedelta(hours=2 if run.sequence == 2 else 0)
        for run in new.runs:
            run.created_at = t0 + timedelta(hours=1)
        s.flush()
        expected = [r.id for r in sorted(new.runs, key=lambda r: r.sequence)]
        expected += [r.id for r in sorted(old.runs, key=lambda r: r.sequence)]
    api = client.get("/api/v1/runs", params={"model": tag}).json()["items"]
    assert [r["id"] for r in api] == expected
    html = client.get("/", params={"model": tag}).text
    shown = [line.split('"')[1] for line in html.split("<tr data-run-id=")[1:]]
    assert shown == expected


def test_sort_keys_follow_the_stored_metrics(session_factory: sessionmaker[Session]) -> None:
    """The run's sort-key columns are its metrics once stored, and None again when a
    later store lacks them."""
    with session_factory.begin() as s:
        run = make_experiment(s, n_runs=1).runs[0]
        repo = RunRepository(s)
        repo.save_measurements(
            run.id,
            metrics={"median_ttft_ms": 12.5, "prefix_cache_hit_rate": 0.25, "other": 1.0},
            samples=[],
            requests=[],
            engine_log="",
        )
        s.refresh(run)
        assert (run.sort_ttft_p50, run.sort_hit_rate, run.sort_ttft_p99) == (12.5, 0.25, None)
        repo.save_recovered(run.id, metrics={"p99_ttft_ms": 40.0}, engine_log="")
        s.refresh(run)
        assert (run.sort_ttft_p50, run.sort_ttft_p99) == (None, 40.0)
        s.execute(
            insert(RunMetric), [{"run_id": run.id, "name": "output_throughput", "value": 9.0}]
        )
        repo.sync_sort_keys([run.id])
        s.refresh(run)
        assert run.sort_output_throughput == 9.0 and run.sort_ttft_p99 == 40.0


def test_the_experiment_list_estimates_a_large_count(
    client: TestClient,
    model: str,
    monkeypatch: pytest.MonkeyPatch,
    session_factory: sessionmaker[Session],
) -> None:
    with session_factory.begin() as s:
        s.execute(text("ANALYZE experiments"))
        exact = s.scalar(text("SELECT count(*) FROM experiments"))
    body = client.get("/api/v1/experiments", params={"limit": 2}).json()
    assert body["total"] == exact and body["total_estimated"] is False
    monkeypatch.setattr(ExperimentRepository, "EXACT_COUNT_UP_TO", 0)
    body = client.get("/api/v1/experiments", params={"limit": 2}).json()
    assert body["total_estimated"] is True and body["total"] >= 3
    assert len(body["items"]) == 2


def test_the_dashboards_next_link_is_a_cursor_to_the_next_rows(
    client: TestClient, model: str
) -> None:
    """The "next" link carries the keyset cursor; following it shows the rows an offset
    page would, and the cursor is dropped when the sort changes."""
    first = client.get("/", params={"model": model, "per_page": 5, "sort": "ttft_p50"}).text
    link = first.split('rel="next"')[0].rsplit('href="', 1)[1].split('"')[0].replace("&amp;", "&")
    assert "cursor=" in link and "page=2" in link
    by_cursor = client.get(link).text
    by_offset = client.get(
        "/", params={"model": model, "per_page": 5, "sort": "ttft_p50", "page": 2}
    ).text

    def ids(html: str) -> list[str]:
        return [line.split('"')[1] for line in html.split("<tr data-run-id=")[1:]]

    assert len(ids(by_cursor)) == 5 and ids(by_cursor) == ids(by_offset)
    assert set(ids(by_cursor)).isdisjoint(ids(first))
    assert "cursor=" not in by_cursor.split('data-sort="model"')[1].split("</th>")[0]
