"""Reads wait for a slot of the read gate (:mod:`api.limits`), not for a pooled connection.

Over real HTTP (uvicorn in a thread, as ``vlab up`` serves) on real Postgres, with a
pool of 3 connections and a gate of 2 reads: reads that sit in a slow handler fill the
gate; the reads behind them wait holding nothing, longer than the pool timeout, and are
answered once a slot frees (without the gate they would take the third connection and then
wait for a fourth: 503 ``database_busy``); meanwhile ``/healthz`` and a write are served,
and while one read is slow another read is answered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine

from api import auth
from api.app import create_app
from api.deps import SessionDep
from orchestrator.core.db import make_session_factory, normalize_url
from orchestrator.core.repositories import RunRepository
from orchestrator.core.settings import ApiSettings, Settings
from tests.api.livehttp import live_server

POOL_TIMEOUT_S = 0.3
GATE = 2


class SlowReads:
    """``GET /api/v1/slow``: takes a pooled connection, then waits until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.inside = 0
        self.most_inside = 0
        self._lock = threading.Lock()

    def handler(self, session: SessionDep) -> dict[str, int]:
        RunRepository(session).metrics("none")  # a query: the connection is checked out
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            assert self.release.wait(timeout=60)
        finally:
            with self._lock:
                self.inside -= 1
        return {"ok": 1}


def _until(check: Any, what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def served(
    settings: Settings, database_url: str, migrated_engine: Any
) -> Iterator[tuple[str, SlowReads]]:
    settings.api = ApiSettings.model_validate(
        {**settings.api.model_dump(), "max_concurrent_reads": GATE}
    )
    engine = create_engine(
        normalize_url(database_url), pool_size=3, max_overflow=0, pool_timeout=POOL_TIMEOUT_S
    )
    slow = SlowReads()
    app = create_app(settings, make_session_factory(engine))
    app.add_api_route("/api/v1/slow", slow.handler, methods=["GET"], dependencies=auth.API_AUTH)
    try:
        with live_server(app) as base:
            yield base, slow
    finally:
        slow.release.set()
        engine.dispose()


def test_reads_beyond_the_gate_wait_for_a_slot_not_a_connection(
    served: tuple[str, SlowReads],
) -> None:
    base, slow = served
    with ThreadPoolExecutor(8) as pool, httpx.Client(base_url=base, timeout=30) as client:
        reads: list[Future[httpx.Response]] = [
            pool.submit(httpx.get, f"{base}/api/v1/slow", timeout=30) for _ in range(5)
        ]
        try:
            _until(lambda: slow.inside == GATE, "two slow reads never got in")
            # the three behind them wait longer than the pool lets a checkout wait
            time.sleep(POOL_TIMEOUT_S * 3)
            assert slow.inside == GATE and not any(f.done() for f in reads)

            assert client.get("/healthz").status_code == 200  # a probe is not gated
            cancel = client.post("/api/v1/runs/no-such-run/cancel")  # a write: not gated
            assert cancel.status_code == 404, cancel.text
        finally:
            slow.release.set()
        answers = [f.result(timeout=30) for f in reads]
    assert [r.status_code for r in answers] == [200] * 5, [r.text for r in answers]
    assert slow.most_inside == GATE


def test_a_read_is_answered_while_another_read_is_in_a_slow_handler(
    served: tuple[str, SlowReads],
) -> None:
    base, slow = served
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=base, timeout=30) as client:
        stuck = pool.submit(httpx.get, f"{base}/api/v1/slow", timeout=30)
        try:
            _until(lambda: slow.inside == 1, "the slow read never got in")
            runs = client.get("/api/v1/runs", params={"limit": 1})
            assert runs.status_code == 200, runs.text
            assert not stuck.done()
        finally:
            slow.release.set()
        assert stuck.result(timeout=30).status_code == 200
