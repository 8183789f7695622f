"""The dispatcher's loops (:mod:`orchestrator.dispatch.loops`): one failing loop does not
stop the others, each loop counts its turns and failures, an interval holds a loop
back, and a database outage ends the tick with one log line.

The runner on its own first (no database), then a real dispatcher on a real Postgres
with a stub run backend whose heartbeat half fails: the other five loops still run and
the queued run is claimed and launched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from jobs.schemas import BatchJob
from orchestrator.core.db import database_health
from orchestrator.core.models import Run
from orchestrator.core.settings import OrchestratorSettings, Settings
from orchestrator.core.telemetry import DISPATCHER_LOOPS, PROCESS_REGISTRY
from orchestrator.dispatch import dispatcher as dispatcher_module
from orchestrator.dispatch.dispatcher import Dispatcher, LaunchInfo, Poll
from orchestrator.dispatch.loops import Loop, LoopRunner
from tests.conftest import fresh_sessions
from tests.factories import make_experiment


def _value(series: str, loop: str) -> float:
    return PROCESS_REGISTRY.get_sample_value(series, {"loop": loop}) or 0.0


def _counts(loops: list[str] | tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """``{loop: (turns, failures)}`` as exported now."""
    return {
        name: (
            _value("vlab_dispatcher_loop_runs_total", name),
            _value("vlab_dispatcher_loop_failures_total", name),
        )
        for name in loops
    }


def _delta(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, tuple[float, float]]:
    return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in before}


def _boom() -> None:
    raise RuntimeError("boom")


# ---- the runner on its own ----------------------------------------------------------------


def test_a_failing_loop_is_logged_and_counted_and_the_others_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[str] = []
    names = ["t-first", "t-broken", "t-last"]
    runner = LoopRunner(
        [
            Loop("t-first", lambda: ran.append("t-first")),
            Loop("t-broken", _boom),
            Loop("t-last", lambda: ran.append("t-last")),
        ]
    )
    before = _counts(names)
    with caplog.at_level(logging.ERROR):
        assert runner.run_due() == ["t-broken"]
        assert runner.run_due() == ["t-broken"]  # tried again on the next tick
    assert ran == ["t-first", "t-last"] * 2
    assert _delta(before, _counts(names)) == {
        "t-first": (2, 0),
        "t-broken": (2, 2),
        "t-last": (2, 0),
    }
    failed = [r for r in caplog.records if "dispatcher loop t-broken failed" in r.getMessage()]
    assert len(failed) == 2 and all(r.exc_info for r in failed)  # with the traceback
    assert runner["t-broken"].last_success is None
    assert runner["t-first"].last_success is not None
    assert _value("vlab_dispatcher_loop_last_success_timestamp_seconds", "t-last") > 1e9
    assert _value("vlab_dispatcher_loop_seconds_count", "t-broken") >= 2  # failed turns timed


def test_an_interval_holds_a_loop_back_until_it_has_passed() -> None:
    ran: list[str] = []
    runner = LoopRunner(
        [
            Loop("t-every-tick", lambda: ran.append("tick")),
            Loop("t-slow", lambda: ran.append("slow"), interval_s=0.3),
        ]
    )
    runner.run_due()
    runner.run_due()
    assert ran == ["tick", "slow", "tick"]  # due at once, then not within its interval
    time.sleep(0.35)
    runner.run_due()
    assert ran[3:] == ["tick", "slow"]


def test_a_database_outage_ends_the_tick_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def outage() -> None:
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    ran: list[str] = []
    names = ["t-before", "t-db", "t-after"]
    runner = LoopRunner(
        [
            Loop("t-before", lambda: ran.append("t-before")),
            Loop("t-db", outage),
            Loop("t-after", lambda: ran.append("t-after")),
        ]
    )
    before = _counts(names)
    database_health.ok()
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(3):
                assert runner.run_due() == ["t-db"]
        assert database_health.down
    finally:
        database_health.ok()
    assert ran == ["t-before"] * 3  # the loops after it wait for the database
    assert _delta(before, _counts(names)) == {
        "t-before": (3, 0),
        "t-db": (3, 3),
        "t-after": (0, 0),
    }
    lines = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in lines] == [
        "database unavailable (dispatcher): connection refused"
    ]
    assert not any(r.exc_info for r in caplog.records)  # no traceback


def test_the_dispatcher_runs_the_seven_loops_in_order_with_their_settings(tmp_path: Path) -> None:
    settings = Settings(
        home=tmp_path / "home",
        orchestrator=OrchestratorSettings(
            stale_after_s=30.0, heartbeat_interval_s=2.0, claim_interval_s=4.0
        ),
    )
    dispatcher = Dispatcher(settings, sessionmaker(), StubBackend())  # type: ignore[arg-type]
    loops = {loop.name: loop.interval_s for loop in dispatcher.loops}
    assert tuple(loops) == DISPATCHER_LOOPS
    assert loops == {
        "heartbeat": 2.0,
        "poll": None,
        "reconcile": 15.0,  # stale_after_s / 2, as before
        "parity": None,
        "schedules": None,
        "claim": 4.0,
        "campaigns": 5.0,
    }
    assert OrchestratorSettings().heartbeat_interval_s == 5.0  # as before


# ---- a real dispatcher ----------------------------------------------------------------------


class StubBackend:
    """A run backend that launches at once and never ends a run; ``resources`` (the
    heartbeat's half) fails while ``broken`` is set."""

    resource = "CPU"

    def __init__(self) -> None:
        self.broken = False
        self.launched: list[str] = []

    def resources(self) -> dict[str, float]:
        if self.broken:
            raise RuntimeError("the cluster's resources cannot be read")
        return {"CPU": 2.0}

    def nodes(self) -> list[Any]:
        return []

    def launch(self, run_id: str, job: BatchJob, layout: dict[str, Any]) -> LaunchInfo:
        self.launched.append(run_id)
        return LaunchInfo(placement={"nodes": ["stub"]})

    def check_nodes(self, *a: Any, **k: Any) -> dict[str, Any]:
        raise AssertionError("no parity checks here")

    def poll(self, run_id: str) -> Poll:
        return Poll(done=False, answered=False)

    def records(self, run_id: str, since: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        return {}

    def samples(self, run_id: str, since: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        return {}

    def cancel(self, run_id: str) -> None:
        pass

    def attach(self, run_id: str) -> bool:
        return False

    def release(self, run_id: str) -> None:
        pass


@pytest.fixture
def factory(server_url: str) -> Iterator[sessionmaker[Session]]:
    """A migrated database of this test's own."""
    with fresh_sessions(server_url) as sessions:
        yield sessions


def test_a_failing_heartbeat_does_not_stop_claiming_and_metrics_count_each_loop(
    factory: sessionmaker[Session], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with factory() as s:
        run_id = make_experiment(s, n_runs=1).runs[0].id
        s.commit()
    backend = StubBackend()
    settings = Settings(home=tmp_path / "home")
    dispatcher = Dispatcher(settings, factory, backend)  # type: ignore[arg-type]
    dispatcher.startup()
    backend.broken = True
    dispatcher.loops["heartbeat"].last_success = None  # due now
    before = _counts(DISPATCHER_LOOPS)
    with caplog.at_level(logging.ERROR):
        dispatcher.tick()
        dispatcher.tick()

    # the heartbeat failed twice; the claim loop launched the queued run all the same
    assert backend.launched == [run_id] and dispatcher.active == {run_id: [run_id]}
    with factory() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.status == "preparing"
        assert run.placement == {"nodes": ["stub"]}
    assert _delta(before, _counts(DISPATCHER_LOOPS)) == {
        "heartbeat": (2, 2),  # retried on the next tick
        "poll": (2, 0),
        "reconcile": (0, 0),  # ran at start-up; not due again for stale_after_s / 2
        "parity": (2, 0),
        "schedules": (2, 0),
        "claim": (2, 0),
        "campaigns": (1, 0),  # every 5 s: not due again on the second tick
    }
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "dispatcher loop heartbeat failed"
    ] * 2

    # back: the heartbeat's next turn succeeds, and its last success moves
    backend.broken = False
    stamp = _value("vlab_dispatcher_loop_last_success_timestamp_seconds", "heartbeat")
    dispatcher.tick()
    assert _value("vlab_dispatcher_loop_failures_total", "heartbeat") == before["heartbeat"][1] + 2
    assert _value("vlab_dispatcher_loop_last_success_timestamp_seconds", "heartbeat") >= stamp
    assert dispatcher.loops["heartbeat"].last_success is not None


def test_a_failing_schedules_loop_does_not_stop_the_claim(
    factory: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with factory() as s:
        run_id = make_experiment(s, n_runs=1).runs[0].id
        s.commit()
    monkeypatch.setattr(dispatcher_module, "fire_due_schedules", lambda *a, **k: _boom())
    backend = StubBackend()
    dispatcher = Dispatcher(Settings(home=tmp_path / "home"), factory, backend)  # type: ignore[arg-type]
    before = _counts(DISPATCHER_LOOPS)
    dispatcher.tick()
    assert backend.launched == [run_id]
    delta = _delta(before, _counts(DISPATCHER_LOOPS))
    assert delta["schedules"] == (1, 1)
    assert all(delta[name] == (1, 0) for name in DISPATCHER_LOOPS if name != "schedules")
