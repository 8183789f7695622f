"""``GET /metrics``: every series docs/OPERATIONS.md documents is in a real scrape (real
Postgres, a fresh database of the test's own), and the values move with what happens:
a submission queues runs, a dispatcher ticks, a configuration check runs, a result
records an engine start-up, a schedule fires and misses. With the database down the
scrape still answers (``vlab_database_up 0``, database series absent); the optional
metrics token guards it without the database.

The scrape is parsed with ``prometheus_client.parser`` (the client library's own parser
of the text format).
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

import jobs.engine.queries
from api.app import create_app
from jobs.schemas import BatchJob, RunResult
from orchestrator.cli.runtime import Runtime
from orchestrator.cluster.placement import NodeInventory
from orchestrator.core import telemetry
from orchestrator.core.db import (
    make_engine,
    make_session_factory,
    unit_of_work,
    upgrade_to_head,
)
from orchestrator.core.models import Schedule, ScheduleFire
from orchestrator.core.repositories import RunRepository
from orchestrator.core.settings import OrchestratorSettings, Settings
from orchestrator.dispatch.dispatcher import Dispatcher, NoCapacity, Poll
from orchestrator.experiments import config_check
from orchestrator.runs.service import record_result
from orchestrator.schedules.service import fire_due_schedules
from tests.conftest import fresh_database

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md"
SPEC: dict[str, Any] = {
    "name": "metrics",
    "model": "tiny",
    "baseline": {
        "engine_args": {"enable_prefix_caching": False, "max_model_len": 1024},
        "workload": {"num_requests": 4, "prefix_tokens": 128, "seed": 3},
    },
    "variants": [{"name": "apc-on", "changes": {"engine_args.enable_prefix_caching": True}}],
}


def documented_series() -> dict[str, str]:
    """``{series name: type}`` of the table in docs/OPERATIONS.md ("The service's own
    metrics"), between its ``metrics-table`` markers."""
    text = OPERATIONS.read_text()
    table = text.split("<!-- metrics-table")[1].split("<!-- /metrics-table -->")[0]
    rows = re.findall(r"^\| `(vlab_[a-z0-9_]+)` \| (gauge|counter|histogram) \|", table, re.M)
    assert rows, "no series documented"
    return dict(rows)


def family_name(series: str, kind: str) -> str:
    """The family name the parser gives a documented series (a counter's without _total)."""
    return series.removesuffix("_total") if kind == "counter" else series


class Scrape:
    """One parsed scrape: ``value(name, **labels)``, ``families`` (with samples)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text) if f.samples}

    def value(self, sample: str, **labels: str) -> float | None:
        for family in self.families.values():
            for s in family.samples:
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        return None


def scrape(client: TestClient, **headers: str) -> Scrape:
    resp = client.get("/metrics", headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return Scrape(resp.text)


class IdleBackend:
    """A run backend with no free devices: the dispatcher ticks, every run stays queued."""

    resource = "CPU"

    def resources(self) -> dict[str, float]:
        return {"CPU": 2.0}

    def nodes(self) -> list[NodeInventory]:
        return []

    def launch(self, run_id: str, job: BatchJob, layout: dict[str, Any]) -> Any:
        raise NoCapacity()

    def check_nodes(self, *a: Any, **k: Any) -> dict[str, Any]:
        raise AssertionError("no parity checks here")

    def poll(self, run_id: str) -> Poll:
        return Poll(done=False)

    def records(self, run_id: str, since: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        return {}

    def cancel(self, run_id: str) -> None:
        pass

    def attach(self, run_id: str) -> bool:
        return False

    def release(self, run_id: str) -> None:
        pass


@pytest.fixture
def own_database(server_url: str) -> Iterator[sessionmaker[Session]]:
    """A fresh, migrated database of this test's own (absolute counts), the service's engine."""
    with fresh_database(server_url) as url:
        upgrade_to_head(url)
        engine = make_engine(url)
        try:
            yield make_session_factory(engine)
        finally:
            engine.dispose()


@pytest.fixture
def no_dispatcher_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as if no dispatcher had ever run in it (other tests start some)."""
    monkeypatch.setattr(telemetry, "_dispatcher_running", threading.Event())


def test_every_documented_series_is_scraped_and_values_move(
    own_database: sessionmaker[Session],
    settings: Settings,
    no_dispatcher_yet: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    factory = own_database
    documented = documented_series()
    settings.orchestrator = OrchestratorSettings(poll_interval_s=0.02)
    with TestClient(create_app(settings, factory)) as client:
        # ---- nothing yet, no dispatcher in this process
        first = scrape(client)
        assert first.value("vlab_database_up") == 1
        assert first.value("vlab_dispatcher_in_process") == 0
        for status in ("queued", "preparing", "running", "succeeded", "failed", "cancelled"):
            assert first.value("vlab_runs", status=status) == 0
        assert "vlab_queue_oldest_age_seconds" not in first.families  # unknown, not 0
        for name in telemetry.DISPATCHER_FAMILIES:  # left out, not exported as zeros
            assert name not in first.families
        assert first.value("vlab_database_pool_size") == 10
        assert first.value("vlab_database_pool_max_overflow") == 30

        # ---- a submission queues its runs
        created = client.post("/api/v1/experiments", json=SPEC)
        assert created.status_code == 201, created.text
        n_runs = len(created.json()["runs"])
        queued = scrape(client)
        assert queued.value("vlab_runs", status="queued") == n_runs
        age = queued.value("vlab_queue_oldest_age_seconds")
        assert age is not None and 0 <= age < 60

        # ---- a dispatcher runs in this process and ticks (no devices free: runs stay queued)
        stop = threading.Event()
        dispatcher = Dispatcher(settings, factory, IdleBackend())
        ticker = threading.Thread(target=dispatcher.run_forever, args=(stop,))
        ticker.start()
        try:
            deadline = time.monotonic() + 30
            while True:
                ticked = scrape(client)
                count = ticked.value("vlab_dispatcher_tick_duration_seconds_count")
                if count is not None and count >= 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            stop.set()
            ticker.join(timeout=60)
        assert ticked.value("vlab_dispatcher_in_process") == 1
        assert (ticked.value("vlab_dispatcher_tick_duration_seconds_count") or 0) >= 2
        assert (ticked.value("vlab_dispatcher_tick_duration_seconds_sum") or 0) > 0
        assert ticked.value("vlab_runs", status="queued") == n_runs

        # ---- every documented series is there, and nothing vlab_* that is not documented
        for series, kind in documented.items():
            assert family_name(series, kind) in ticked.families, f"{series} not scraped"
            assert ticked.families[family_name(series, kind)].type == kind, series
        # (prometheus_client's *_created series, the creation time of a counter or
        # histogram, parse as families of their own)
        scraped = {
            n for n in ticked.families if n.startswith("vlab_") and not n.endswith("_created")
        }
        assert scraped <= {family_name(s, k) for s, k in documented.items()}

        # ---- a vLLM configuration check (one-shot process), in flight while it runs
        seen: dict[str, float | None] = {}

        def fake_resolve(python: str, model_dir: str, configs: list[Any]) -> dict[str, Any]:
            seen["in_flight"] = scrape(client).value("vlab_config_checks_in_flight")
            time.sleep(0.05)
            return {"results": [{} for _ in configs]}

        monkeypatch.setattr(jobs.engine.queries, "resolve_engine_configs", fake_resolve)
        settings.submissions.warm_resolver = False
        before = ticked.value("vlab_config_check_duration_seconds_count", resolver="one_shot")
        config_check.resolve_configs(settings, "/nowhere", [{}, {}])
        checked = scrape(client)
        assert seen["in_flight"] == 1
        assert checked.value("vlab_config_checks_in_flight") == 0
        after = checked.value("vlab_config_check_duration_seconds_count", resolver="one_shot")
        assert after == (before or 0) + 1
        assert (
            checked.value("vlab_config_check_duration_seconds_sum", resolver="one_shot") or 0
        ) >= 0.05

        # ---- a submission slot held
        with config_check.gate_for(settings).slot():
            assert scrape(client).value("vlab_submission_checks_running") == 1
        assert scrape(client).value("vlab_submission_checks_running") == 0

        # ---- a run's result records its engine's start-up (12.5 s)
        before_n = checked.value("vlab_engine_startup_seconds_count") or 0
        before_sum = checked.value("vlab_engine_startup_seconds_sum") or 0
        with unit_of_work(factory) as s:
            run = RunRepository(s).claim_next_queued("test-metrics")
            assert run is not None
            result = RunResult(
                run_id=run.id, status="failed", error="stopped", timings={"startup_s": 12.5}
            )
            record_result(s, run, result)
        recorded = scrape(client)
        assert recorded.value("vlab_engine_startup_seconds_count") == before_n + 1
        assert recorded.value("vlab_engine_startup_seconds_sum") == pytest.approx(before_sum + 12.5)
        assert recorded.value("vlab_engine_startup_seconds_bucket", le="20.0") is not None
        assert recorded.value("vlab_runs", status="queued") == n_runs - 1
        assert recorded.value("vlab_runs", status="failed") == 1

        # ---- a schedule two days behind: two missed fire times, the latest fired (and
        # failed: its template is refused)
        misses0 = recorded.value("vlab_schedule_misses_total") or 0
        failed0 = recorded.value("vlab_schedule_fires_total", status="failed") or 0
        with unit_of_work(factory) as s:
            sched = Schedule(
                name="nightly-metrics",
                cron="0 3 * * *",
                timezone="UTC",
                template={"name": "refused"},
                next_fire_at=datetime(2026, 1, 1, 3, tzinfo=UTC),
            )
            s.add(sched)
        fire_due_schedules(factory, settings, now=datetime(2026, 1, 3, 12, tzinfo=UTC))
        with unit_of_work(factory) as s:
            rows = s.scalars(select(ScheduleFire.status)).all()
        assert sorted(rows) == ["failed", "skipped", "skipped"]
        fired = scrape(client)
        assert fired.value("vlab_schedule_misses_total") == misses0 + 2
        assert fired.value("vlab_schedule_fires_total", status="failed") == failed0 + 1

        # ---- the pool: a connection held is checked out
        with factory() as s:
            s.connection()
            held = scrape(client)
        assert (held.value("vlab_database_pool_checked_out_connections") or 0) >= 1
        assert (held.value("vlab_database_pool_open_connections") or 0) >= 1


def test_database_down_still_answers_without_the_database_series(settings: Settings) -> None:
    engine = make_engine("postgresql://postgres@127.0.0.1:1/nothing", connect_timeout_s=1)
    try:
        with TestClient(create_app(settings, make_session_factory(engine))) as client:
            t0 = time.monotonic()
            down = scrape(client)
            assert time.monotonic() - t0 < 10
    finally:
        engine.dispose()
    assert down.value("vlab_database_up") == 0
    assert "vlab_runs" not in down.families  # unknown, never a stale or made-up count
    assert "vlab_queue_oldest_age_seconds" not in down.families
    assert down.value("vlab_database_pool_size") == 10  # what this process knows stays


def test_metrics_token_guards_the_scrape_without_the_database(settings: Settings) -> None:
    settings.api.metrics_token = SecretStr("s3cret-metrics")
    engine = make_engine("postgresql://postgres@127.0.0.1:1/nothing", connect_timeout_s=1)
    try:
        with TestClient(create_app(settings, make_session_factory(engine))) as client:
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "s3cret-metrics"},
            ):
                resp = client.get("/metrics", headers=headers)
                assert resp.status_code == 401, headers
                assert resp.headers["content-type"] == "application/problem+json"
                assert resp.json()["code"] == "unauthenticated"
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            ok = scrape(client, Authorization="Bearer s3cret-metrics")
            assert ok.value("vlab_database_up") == 0  # answered with the database down
    finally:
        engine.dispose()


def test_orchestrate_metrics_port_serves_the_same_scrape(
    own_database: sessionmaker[Session], settings: Settings
) -> None:
    """``vlab orchestrate --metrics-port``: the orchestrator process serves ``/metrics``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rt = Runtime(settings)
    rt.session_factory = own_database
    try:
        rt.start_metrics_thread("127.0.0.1", port)
        resp = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert resp.status_code == 200
        got = Scrape(resp.text)
        assert got.value("vlab_database_up") == 1
        assert got.value("vlab_runs", status="queued") == 0
        assert httpx.get(f"http://127.0.0.1:{port}/api/v1/runs", timeout=30).status_code == 404
    finally:
        rt.stop()
