"""A database outage, on a throw-away Postgres of the test's own (the embedded server in a
temporary folder), with the API served over real HTTP and the dispatcher running.

While the database is stopped: every API endpoint that needs it answers 503
problem+json ``database_unavailable`` (with ``Retry-After``, and no exception class
name, SQL or server path in the body), the dashboard pages answer a 503 HTML page
saying the database is down, ``/healthz`` answers 503 naming the database; the log
has one line when the outage starts (API and dispatcher together) and one when it
ends, no traceback. Once the database is back, everything answers again without a
restart.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from jobs.schemas import BatchJob
from orchestrator.cluster.placement import NodeInventory
from orchestrator.core.db import (
    SETTLE_S,
    database_health,
    make_engine,
    make_session_factory,
    start_embedded_postgres,
    stop_embedded_postgres,
    upgrade_to_head,
)
from orchestrator.core.settings import ApiSettings, OrchestratorSettings, Settings
from orchestrator.dispatch.dispatcher import Dispatcher, NoCapacity, Poll
from tests.api.livehttp import live_server

PROBLEM = "application/problem+json"
SPEC: dict[str, Any] = {
    "name": "outage",
    "model": "tiny",
    "baseline": {
        "engine_args": {"enable_prefix_caching": False, "max_model_len": 1024},
        "workload": {"num_requests": 4, "prefix_tokens": 128, "seed": 3},
    },
    "variants": [{"name": "apc-on", "changes": {"engine_args.enable_prefix_caching": True}}],
}

VARIANT = {"name": "seqs", "changes": {"engine_args.max_num_seqs": 4}}
SCHEDULE = {"name": "nightly", "cron": "0 3 * * *", "template": SPEC}
CAMPAIGN = {
    "name": "tune",
    "model": "tiny",
    "baseline": SPEC["baseline"],
    "objective": {"metric": "output_throughput"},
    "space": [{"name": "engine_args.enable_prefix_caching", "levels": [False, True]}],
    "budget": {"max_runs": 20},
}


class IdleBackend:
    """A run backend with no capacity: the dispatcher ticks, claims nothing to run."""

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

    def cancel(self, run_id: str) -> None:
        pass

    def attach(self, run_id: str) -> bool:
        return False

    def release(self, run_id: str) -> None:
        pass


@pytest.fixture
def own_postgres(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A throw-away embedded Postgres (never the machine's main one), migrated."""
    pgdata = tmp_path / "pgdata"
    url = start_embedded_postgres(pgdata)
    upgrade_to_head(url)
    yield pgdata, url
    stop_embedded_postgres(pgdata)


def _leaks(text: str, *paths: str) -> list[str]:
    """What a problem body must not carry: exception class names, SQL, server paths."""
    found = re.findall(r"\b\w+(?:Error|Exception)\b", text)
    found += [w for w in ("sqlalchemy", "psycopg", "SELECT", "Traceback") if w in text]
    found += [p for p in paths if p and p in text]
    return found


@pytest.mark.timing
def test_database_outage_is_503_everywhere_logged_once_and_recovers(
    own_postgres: tuple[Path, str],
    settings: Settings,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    pgdata, url = own_postgres
    settings.api = ApiSettings.model_validate({**settings.api.model_dump(), "auth": "none"})
    settings.orchestrator = OrchestratorSettings(poll_interval_s=0.05)
    engine = make_engine(url)
    factory: sessionmaker[Session] = make_session_factory(engine)
    app = create_app(settings, factory)
    database_health.ok()
    caplog.set_level(logging.INFO)
    stop_dispatcher = threading.Event()
    stop_polling = threading.Event()  # set in ``finally``: a failed assertion ends the poller too
    dispatcher = Dispatcher(settings, factory, IdleBackend())
    figures: dict[str, Any] = {}
    ticker: threading.Thread | None = None
    try:
        with live_server(app) as base, httpx.Client(base_url=base, timeout=30) as c:
            created = c.post("/api/v1/experiments", json=SPEC)
            assert created.status_code == 201, created.text
            exp_id, run_id = created.json()["id"], created.json()["runs"][0]["id"]
            assert c.get("/healthz").json() == {"status": "ok", "database": "ok"}
            ticker = threading.Thread(target=dispatcher.run_forever, args=(stop_dispatcher,))
            ticker.start()
            time.sleep(0.3)

            # ---- the database goes away
            polled: list[tuple[float, int]] = []

            def poll() -> None:
                with httpx.Client(base_url=base, timeout=30) as pc:
                    while not stop_polling.is_set():
                        try:
                            status = pc.get("/api/v1/experiments").status_code
                        except httpx.HTTPError:
                            status = -1
                        polled.append((time.monotonic(), status))
                        stop_polling.wait(0.02)

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            time.sleep(0.2)
            caplog.clear()
            t_stop = time.monotonic()
            stop_embedded_postgres(pgdata)
            t_stopped = time.monotonic()
            deadline = time.monotonic() + 10
            while not any(s == 503 for t, s in polled if t >= t_stop) and (
                time.monotonic() < deadline
            ):
                time.sleep(0.01)
            after = [t for t, s in polled if s == 503 and t >= t_stop]
            assert after, f"no 503 within 10 s of the stop: {sorted({s for _, s in polled})}"
            first_503 = min(after)
            figures["pg_stop_s"] = round(t_stopped - t_stop, 3)
            figures["first_503_after_stop_returned_s"] = round(first_503 - t_stopped, 3)
            figures["first_503_after_stop_began_s"] = round(first_503 - t_stop, 3)
            assert 500 not in [s for _, s in polled]

            # every API endpoint
            api_routes = [
                (path, method.upper())
                for path, item in app.openapi()["paths"].items()
                if path.startswith("/api/v1/")
                for method in item
            ]
            ids = {
                "experiment_id": exp_id,
                "run_id": run_id,
                "schedule_id": "sched-x",
                "check_id": "check-x",
            }
            answers: dict[str, int] = {}
            slowest = 0.0
            for template, method in api_routes:
                path = re.sub(r"\{(\w+)\}", lambda m: ids.get(m.group(1), "x"), template)
                body = {
                    "/api/v1/experiments": SPEC,
                    "/api/v1/runs/{run_id}/variants": VARIANT,
                    "/api/v1/schedules": SCHEDULE,
                    "/api/v1/campaigns": CAMPAIGN,
                }.get(template, {})
                t0 = time.monotonic()
                r = c.request(method, path, json=body if method != "GET" else None)
                slowest = max(slowest, time.monotonic() - t0)
                answers[f"{method} {template}"] = r.status_code
                assert r.status_code != 500, (method, path, r.text)
                if r.status_code == 503:
                    assert r.headers["content-type"].startswith(PROBLEM)
                    assert r.json()["code"] == "database_unavailable", r.text
                    assert int(r.headers["retry-after"]) >= 1
                    assert not _leaks(r.text, str(tmp_path), str(pgdata)), r.text
            # the ones that cannot answer without the database: all of them but the few
            # refused before any database work (a body the schema rejects: 422)
            unavailable = [k for k, v in answers.items() if v == 503]
            assert all(v in (503, 422) for k, v in answers.items() if "/auth/" not in k)
            # refused before any database work: a body the schema rejects, and who am I
            assert {k for k, v in answers.items() if v != 503} == {
                "GET /api/v1/auth/me",
                "POST /api/v1/tokens",
                "POST /api/v1/experiments/{experiment_id}/export/mlflow",
                "POST /api/v1/campaigns/{campaign_id}/export/mlflow",
                "POST /api/v1/analyze/kv-cache",
                "POST /api/v1/analyze/prefix",
            }, {k: v for k, v in answers.items() if v != 503}
            for key in (
                "GET /api/v1/experiments",
                "POST /api/v1/experiments",
                "POST /api/v1/runs/{run_id}/variants",
                "POST /api/v1/schedules",
                "GET /api/v1/experiments/{experiment_id}",
                "GET /api/v1/runs/{run_id}",
                "POST /api/v1/runs/{run_id}/cancel",
                "GET /api/v1/schedules",
                "POST /api/v1/campaigns",
                "GET /api/v1/campaigns",
                "GET /api/v1/campaigns/{campaign_id}",
            ):
                assert answers[key] == 503, (key, answers)
            figures["api_endpoints_503"] = f"{len(unavailable)}/{len(answers)}"
            figures["api_endpoints_not_503"] = {k: v for k, v in answers.items() if v != 503}
            figures["slowest_503_s"] = round(slowest, 3)

            # the dashboard pages: a page saying the database is down
            for page in ("/", f"/experiments/{exp_id}", f"/runs/{run_id}", "/schedules"):
                r = c.get(page, headers={"accept": "text/html"})
                assert r.status_code == 503, (page, r.status_code)
                assert r.headers["content-type"].startswith("text/html")
                assert "Database unavailable" in r.text and "database" in r.text
                assert not _leaks(r.text, str(tmp_path), str(pgdata))

            # the health check says what is down
            r = c.get("/healthz")
            assert r.status_code == 503
            health = r.json()
            assert health["database"] == "down" and health["code"] == "database_unavailable"
            assert health["down_since"]
            assert not _leaks(r.text, str(tmp_path), str(pgdata))

            time.sleep(0.5)  # ~10 more dispatcher ticks in the outage
            outage_logs = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
            down = [rec for rec in outage_logs if "database unavailable" in rec.getMessage()]
            assert len(down) == 1, [rec.getMessage() for rec in outage_logs]
            assert not [rec for rec in caplog.records if rec.exc_info], [
                rec.getMessage() for rec in caplog.records if rec.exc_info
            ]
            assert not [rec for rec in caplog.records if "tick failed" in rec.getMessage()]
            figures["log_lines_during_outage"] = [rec.getMessage() for rec in outage_logs]

            # ---- the database comes back: no restart of the service
            t_start = time.monotonic()
            assert start_embedded_postgres(pgdata) == url
            t_started = time.monotonic()
            deadline = time.monotonic() + 15
            while c.get("/api/v1/experiments").status_code != 200:
                assert time.monotonic() < deadline, "the API did not recover"
                time.sleep(0.05)
            figures["pg_start_s"] = round(t_started - t_start, 3)
            figures["first_200_after_start_s"] = round(time.monotonic() - t_started, 3)
            assert c.get("/healthz").status_code == 200
            assert c.get(f"/api/v1/experiments/{exp_id}").status_code == 200
            assert c.get("/", headers={"accept": "text/html"}).status_code == 200
            assert c.post("/api/v1/experiments", json=SPEC).status_code == 201
            # "back" is logged once the database has answered for SETTLE_S (the ticks go on)
            deadline = time.monotonic() + SETTLE_S + 10

            def back() -> list[logging.LogRecord]:
                return [r for r in caplog.records if "database is back" in r.getMessage()]

            while not back() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            assert len(back()) == 1, [r.getMessage() for r in caplog.records]
            assert not database_health.down
            stop_polling.set()
            poller.join()
    finally:
        stop_polling.set()
        stop_dispatcher.set()
        if ticker is not None:
            ticker.join(timeout=30)
        engine.dispose()
    figures["polls_during_outage"] = sum(1 for t, s in polled if s == 503)
    print("\noutage figures:", json.dumps(figures))
    (tmp_path / "outage.json").write_text(json.dumps(figures))


def test_no_free_pooled_connection_is_a_503_database_busy_and_health_still_answers(
    settings: Settings, migrated_engine: Any, database_url: str
) -> None:
    from fastapi.testclient import TestClient
    from sqlalchemy import create_engine

    from orchestrator.core.db import normalize_url

    settings.api = ApiSettings.model_validate({**settings.api.model_dump(), "auth": "none"})
    engine = create_engine(
        normalize_url(database_url), pool_size=1, max_overflow=0, pool_timeout=0.2
    )
    held = engine.connect()  # the pool's only connection
    try:
        with TestClient(create_app(settings, make_session_factory(engine))) as c:
            r = c.get("/api/v1/experiments")
            health = c.get("/healthz")
    finally:
        held.close()
        engine.dispose()
    assert r.status_code == 503, r.text
    assert r.json()["code"] == "database_busy" and int(r.headers["retry-after"]) >= 1
    assert not _leaks(r.text)
    assert health.status_code == 200  # the health check has its own connection
