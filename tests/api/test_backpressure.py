"""Back-pressure on submissions, over real HTTP (uvicorn in a thread) and a real Postgres.

vLLM's configuration check (``jobs.engine.queries.resolve_engine_configs``: 6-80 s and
~400 MB per call, cold) is replaced by a fake that blocks until the test lets it
go, so the burst is deterministic: with 2 check slots and 4 waiting places, 6 of
40 concurrent submissions are stored (201) and 34 are refused at once with 503
``submissions_busy`` + ``Retry-After``; none is a 500, no database connection is
held while a check runs, and ``/healthz`` and the reads answer meanwhile.

The engine-marked tests use the real vLLM (warm resolver process).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from orchestrator.core.db import make_engine, make_session_factory
from orchestrator.core.models import Experiment
from orchestrator.core.settings import ApiSettings, EngineSettings, Settings, SubmissionSettings
from orchestrator.experiments import config_check
from orchestrator.experiments.config_check import CheckGate, SubmissionsBusyError
from tests.api.livehttp import live_server
from tests.conftest import ENGINE_PYTHON, needs_engine

PROBLEM = "application/problem+json"
SLOTS, WAITING, BURST = 2, 4, 40


def spec(name: str, **kw: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": name,
        "model": "tiny",
        "baseline": {
            "engine_args": {"enable_prefix_caching": False, "max_model_len": 1024},
            "workload": {"num_requests": 4, "prefix_tokens": 128, "seed": 3},
        },
        "variants": [{"name": "apc-on", "changes": {"engine_args.enable_prefix_caching": True}}],
        "repeats": 1,
    }
    doc.update(kw)
    return doc


class SlowResolver:
    """Stands in for ``jobs.engine.queries.resolve_engine_configs``: blocks until ``release``
    is set, counts calls and the most running at once, and notes how many pooled
    connections were checked out when each call started."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)
        self._lock = threading.Lock()
        self.active = self.max_active = self.calls = 0
        self.checked_out: list[int] = []

    def __call__(
        self, engine_python: str, model_dir: str, configs: list[dict[str, Any]], *a: Any, **k: Any
    ) -> dict[str, Any]:
        with self._lock:
            self.calls += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.checked_out.append(self.engine.pool.checkedout())  # type: ignore[attr-defined]
        self.entered.release()
        try:
            self.release.wait(timeout=60)
        finally:
            with self._lock:
                self.active -= 1
        return {
            "vllm_version": "0.32.0",
            "results": [{"ok": True, "argv": [], "config": {}} for _ in configs],
        }


@pytest.fixture
def pool_engine(migrated_engine: Engine, database_url: str) -> Iterator[Engine]:
    """The service's own engine (``make_engine``: pool 10 + 10) on the test database."""
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def checking_settings(settings: Settings) -> Settings:
    """The API test settings with vLLM's check on (through the fake) and a small gate."""
    settings.engine = EngineSettings(python=settings.engine.python, resolve_configs=True)
    settings.submissions = SubmissionSettings(
        max_concurrent_checks=SLOTS, max_waiting=WAITING, wait_timeout_s=60, warm_resolver=False
    )
    # open access for the test (ignored where the auth settings do not exist)
    settings.api = ApiSettings.model_validate({**settings.api.model_dump(), "auth": "none"})
    return settings


@pytest.fixture
def slow(pool_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowResolver]:
    import jobs.engine.queries

    fake = SlowResolver(pool_engine)
    monkeypatch.setattr(jobs.engine.queries, "resolve_engine_configs", fake)
    yield fake
    fake.release.set()


@pytest.fixture
def base_url(checking_settings: Settings, pool_engine: Engine) -> Iterator[str]:
    app = create_app(checking_settings, make_session_factory(pool_engine))
    with live_server(app) as url:
        yield url


def count_named(factory: sessionmaker[Session], prefix: str) -> int:
    with factory() as s:
        return int(
            s.scalar(
                select(func.count())
                .select_from(Experiment)
                .where(Experiment.name.like(f"{prefix}%"))
            )
            or 0
        )


# ------------------------------------------------------------------ no connection held


def _blocked_submission(
    base_url: str, slow: SlowResolver, method: str, path: str, body: dict[str, Any]
) -> tuple[int, httpx.Response]:
    """Send one submission whose check blocks; returns (connections checked out while it
    was blocked, its response once released)."""
    slow.release.clear()
    slow.entered = threading.Semaphore(0)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.request, method, base_url + path, json=body, timeout=60)
        assert slow.entered.acquire(timeout=30), "the check never started"
        time.sleep(0.2)  # anything the request still held would show now
        held = slow.engine.pool.checkedout()  # type: ignore[attr-defined]
        slow.release.set()
        return held, fut.result()


def test_no_database_connection_is_held_while_vllm_checks(
    base_url: str, slow: SlowResolver
) -> None:
    """A submission gives its connection back before vLLM's check, for every route that
    asks vLLM: new experiment, new variant, new schedule, changed schedule template."""
    held, resp = _blocked_submission(base_url, slow, "POST", "/api/v1/experiments", spec("held"))
    assert resp.status_code == 201, resp.text
    assert held == 0
    run_id = resp.json()["runs"][0]["id"]

    held, resp = _blocked_submission(
        base_url,
        slow,
        "POST",
        f"/api/v1/runs/{run_id}/variants",
        {"name": "seqs", "changes": {"engine_args.max_num_seqs": 4}},
    )
    assert resp.status_code == 201, resp.text
    assert held == 0

    calls = slow.calls
    sched = {"name": "nightly-held", "cron": "0 3 * * *", "template": spec("tmpl")}
    held, resp = _blocked_submission(base_url, slow, "POST", "/api/v1/schedules", sched)
    assert resp.status_code == 201, resp.text
    assert held == 0
    assert slow.calls == calls + 1  # the validation in the transaction reused the answer

    held, resp = _blocked_submission(
        base_url,
        slow,
        "PATCH",
        f"/api/v1/schedules/{resp.json()['id']}",
        {"template": spec("tmpl2", repeats=2)},
    )
    assert resp.status_code == 200, resp.text
    assert held == 0


# ------------------------------------------------------------------ the burst


def _poll(url: str, stop: threading.Event, out: list[tuple[float, int]], every_s: float) -> None:
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                status = c.get(url).status_code
            except httpx.HTTPError:
                status = -1
            out.append((time.monotonic() - t0, status))
            stop.wait(every_s)


def _figures(samples: list[tuple[float, int]]) -> dict[str, float]:
    lat = sorted(s[0] * 1000 for s in samples)
    return {
        "n": len(lat),
        "p50_ms": round(statistics.median(lat), 1),
        "p95_ms": round(lat[int(0.95 * (len(lat) - 1))], 1),
        "max_ms": round(lat[-1], 1),
    }


@pytest.mark.timing
def test_a_burst_of_40_submissions_is_held_back_never_a_500(
    base_url: str, slow: SlowResolver, pool_engine: Engine, tmp_path: Path
) -> None:
    # the model exists before the burst (its first generation is not what is measured)
    slow.release.set()
    assert httpx.post(base_url + "/api/v1/experiments", json=spec("warmup")).status_code == 201
    slow.release.clear()
    slow.max_active = 0

    stop = threading.Event()
    health: list[tuple[float, int]] = []
    reads: list[tuple[float, int]] = []
    pollers = [
        threading.Thread(target=_poll, args=(base_url + "/healthz", stop, health, 0.05)),
        threading.Thread(
            target=_poll, args=(base_url + "/api/v1/experiments?limit=5", stop, reads, 0.1)
        ),
        threading.Thread(target=_poll, args=(base_url + "/api/v1/runs?limit=5", stop, reads, 0.1)),
    ]
    for t in pollers:
        t.start()
    t0 = time.monotonic()
    responses: list[httpx.Response] = []
    limits = httpx.Limits(max_connections=BURST + 10, max_keepalive_connections=BURST + 10)
    with (
        httpx.Client(timeout=120, limits=limits) as client,
        ThreadPoolExecutor(BURST) as pool,
    ):
        futures = [
            pool.submit(client.post, base_url + "/api/v1/experiments", json=spec(f"burst-{i}"))
            for i in range(BURST)
        ]
        # every submission beyond the slots and the waiting room is answered while the
        # admitted ones are still blocked in vLLM's check
        refused_by = None
        for fut in as_completed(futures, timeout=30):
            responses.append(fut.result())
            if len(responses) == BURST - SLOTS - WAITING:
                refused_by = time.monotonic() - t0
                break
        blocked_checks = slow.active
        time.sleep(0.3)  # reads and health checks while the checks are still blocked
        slow.release.set()
        for fut in futures:
            if fut.result() not in responses:
                responses.append(fut.result())
    stop.set()
    for t in pollers:
        t.join()

    statuses = [r.status_code for r in responses]
    created, busy = statuses.count(201), statuses.count(503)
    figures = {
        "submissions": BURST,
        "created_201": created,
        "busy_503": busy,
        "other": len(statuses) - created - busy,
        "refused_within_s": round(refused_by or -1, 3),
        "checks_at_once_max": slow.max_active,
        "healthz": _figures(health),
        "reads": _figures(reads),
    }
    print("\nburst figures:", json.dumps(figures))
    (tmp_path / "burst.json").write_text(json.dumps(figures))

    assert 500 not in statuses
    assert created == SLOTS + WAITING and busy == BURST - SLOTS - WAITING, statuses
    assert refused_by is not None and blocked_checks == SLOTS
    for r in responses:
        if r.status_code == 503:
            assert r.headers["content-type"].startswith(PROBLEM)
            assert r.json()["code"] == "submissions_busy"
            assert int(r.headers["retry-after"]) >= 1
    assert slow.max_active <= SLOTS
    assert count_named(make_session_factory(pool_engine), "burst-") == created
    assert health and all(status == 200 for _, status in health), health
    assert max(lat for lat, _ in health) < 1.0
    assert reads and all(status == 200 for _, status in reads), reads
    assert max(lat for lat, _ in reads) < 2.0


# ------------------------------------------------------------------ the gate itself


def test_gate_refuses_at_once_when_the_waiting_room_is_full_and_after_its_timeout() -> None:
    gate = CheckGate(slots=1, max_waiting=1, wait_timeout_s=0.3, retry_after_s=7)
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with gate.slot():
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(5)
    waited: list[BaseException] = []

    def wait() -> None:
        try:
            with gate.slot():
                pass
        except SubmissionsBusyError as exc:
            waited.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(SubmissionsBusyError) as full, gate.slot():
        pass
    assert time.monotonic() - t0 < 0.1  # refused at once, not after waiting
    assert full.value.extra["retry_after_s"] == 7 and full.value.status == 503
    waiter.join()
    assert waited and "0.3 s" in str(waited[0])  # the waiter gave up after the timeout
    leave.set()
    holder.join()
    assert gate.stats() == {"running": 0, "waiting": 0, "slots": 1, "max_waiting": 1}


def test_gate_is_reentrant_for_the_thread_that_holds_a_slot() -> None:
    gate = CheckGate(slots=1, max_waiting=0, wait_timeout_s=0.1, retry_after_s=1)
    with gate.slot(), gate.slot():  # a submission's slot, then its resolver's
        assert gate.stats()["running"] == 1
    assert gate.stats()["running"] == 0


# ------------------------------------------------------------------ the real vLLM


@pytest.mark.engine
@needs_engine
def test_warm_resolver_answers_as_a_one_shot_vllm_process(tmp_path: Path) -> None:
    """The warm process gives the same answers as ``vllm_launcher.py resolve`` (cold),
    refusals included, and answers later checks in well under a second."""
    from jobs.engine.queries import resolve_engine_configs
    from jobs.modelgen.generator import generate_model

    assert ENGINE_PYTHON is not None
    model = tmp_path / "tiny"
    generate_model(model, "tiny")
    configs = [
        {"load_format": "dummy", "max_model_len": 512},
        {"load_format": "dummy", "max_model_len": 512, "enable_prefix_caching": True},
        {"load_format": "dummy", "max_model_len": 512, "kv_cache_dtype": "bogus"},  # refused
    ]
    t0 = time.monotonic()
    cold = resolve_engine_configs(ENGINE_PYTHON, str(model), configs)
    cold_s = time.monotonic() - t0
    warm = config_check.WarmResolver(ENGINE_PYTHON, idle_s=60)
    try:
        t0 = time.monotonic()
        first = warm.resolve(str(model), configs)
        start_s = time.monotonic() - t0
        t0 = time.monotonic()
        again = warm.resolve(str(model), configs[:1])
        warm_s = time.monotonic() - t0
    finally:
        warm.close()
    print(f"\nresolve: cold {cold_s:.1f} s, warm start {start_s:.1f} s, warm call {warm_s:.3f} s")
    assert first["results"] == cold["results"]
    assert [r["ok"] for r in first["results"]] == [True, True, False]
    assert again["results"] == cold["results"][:1]
    assert warm_s < 2.0


@pytest.mark.engine
@pytest.mark.timing  # /healthz within 1 s during the burst: beside three workers it took 1.9 s
@needs_engine
def test_burst_with_the_real_vllm_check(
    settings: Settings, pool_engine: Engine, tmp_path: Path
) -> None:
    """40 concurrent submissions checked by the real vLLM (one warm process, 2 slots, 8
    waiting): each is a 201 or a 503 ``submissions_busy``, and /healthz stays fast."""
    assert ENGINE_PYTHON is not None
    settings.engine = EngineSettings(python=Path(ENGINE_PYTHON), resolve_configs=True)
    settings.submissions = SubmissionSettings(wait_timeout_s=240)
    settings.api = ApiSettings.model_validate({**settings.api.model_dump(), "auth": "none"})
    config_check.close_warm_resolvers()
    app = create_app(settings, make_session_factory(pool_engine))
    stop = threading.Event()
    health: list[tuple[float, int]] = []
    with live_server(app) as url:
        poller = threading.Thread(target=_poll, args=(url + "/healthz", stop, health, 0.1))
        poller.start()
        t0 = time.monotonic()
        with (
            httpx.Client(timeout=300, limits=httpx.Limits(max_connections=60)) as client,
            ThreadPoolExecutor(BURST) as pool,
        ):
            futures = [
                pool.submit(client.post, url + "/api/v1/experiments", json=spec(f"real-{i}"))
                for i in range(BURST)
            ]
            responses = [f.result() for f in futures]
        took = time.monotonic() - t0
        stop.set()
        poller.join()
    warm = config_check.warm_resolver(settings)
    statuses = [r.status_code for r in responses]
    figures = {
        "created_201": statuses.count(201),
        "busy_503": statuses.count(503),
        "other": [s for s in statuses if s not in (201, 503)],
        "burst_s": round(took, 1),
        "warm_processes_started": warm.started,
        "healthz": _figures(health),
    }
    print("\nreal burst figures:", json.dumps(figures))
    config_check.close_warm_resolvers()
    assert set(statuses) <= {201, 503}, [r.text for r in responses if r.status_code >= 500]
    assert statuses.count(201) >= settings.submissions.max_concurrent_checks
    assert warm.started == 1
    assert all(status == 200 for _, status in health)
    assert max(lat for lat, _ in health) < 1.0


def test_background_checks_wait_instead_of_being_refused() -> None:
    """A scheduled sweep's check (``patient``) is not refused for a full waiting room."""
    gate = CheckGate(slots=1, max_waiting=0, wait_timeout_s=5, retry_after_s=1)
    leave, got = threading.Event(), threading.Event()

    def hold() -> None:
        with gate.slot():
            leave.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    time.sleep(0.05)
    with pytest.raises(SubmissionsBusyError), gate.slot():
        pass

    def background() -> None:
        with gate.slot(patient=True):
            got.set()

    waiter = threading.Thread(target=background)
    waiter.start()
    time.sleep(0.1)
    assert not got.is_set()
    leave.set()
    assert got.wait(5)
    holder.join()
    waiter.join()
