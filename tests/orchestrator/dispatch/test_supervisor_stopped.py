"""SIGSTOP of a run's supervisor (the Ray worker of ``ray::RunSupervisor``) while the run
measures, beside another run: the stopped run fails within ``stale_after_s`` of its
supervisor's last answer (plus a call's timeout and a tick), ``partial``, with every
request record that reached durability; its supervisor and engine are gone; the other
run's ticks go on (its heartbeat stays fresh and its records keep streaming).

Real Postgres, real Ray (a local node), the real dispatcher, backend, supervisor and
runner; the engine is the TEST DOUBLE of :mod:`tests.orchestrator.dispatch.test_supervisor_killed`
(the real launcher with its lifetime guard, the project's stub server in place of vLLM).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from jobs.engine.processes import engine_processes, process_alive, process_start_time, process_title
from jobs.run.journal import read_journal
from orchestrator.core.models import Run
from orchestrator.core.repositories import RunRepository, utcnow
from orchestrator.core.settings import EngineSettings, OrchestratorSettings, Settings
from orchestrator.core.states import is_terminal
from orchestrator.dispatch.dispatcher import Dispatcher
from orchestrator.dispatch.ray.backend import CALL_TIMEOUT_S, RayRunBackend
from tests.conftest import REPO
from tests.factories import make_experiment
from tests.orchestrator.dispatch.raydb import ray_and_database
from tests.orchestrator.dispatch.test_supervisor_killed import STUB_ENGINE

TICK_S = 0.5
#: The heartbeat age that marks a run lost, small so the test is short.
STALE_AFTER_S = 6.0
#: Slack for a loaded 2-core machine (process starts, Ray's timers, the database).
SLACK_S = 4.0


@pytest.fixture
def setup(tmp_path: Path, server_url: str) -> Iterator[dict[str, Any]]:
    with ray_and_database(
        tmp_path, server_url, STUB_ENGINE.format(python=sys.executable, repo=str(REPO))
    ) as found:
        yield found


class TimedDispatcher(Dispatcher):
    """The dispatcher, noting how long each tick took (``(start, seconds)``)."""

    ticks: list[tuple[float, float]]

    def tick(self) -> None:
        t0 = time.monotonic()
        try:
            super().tick()
        finally:
            self.ticks.append((t0, time.monotonic() - t0))


def _wait(what: str, timeout_s: float, check: Any) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def _run(factory: sessionmaker[Session], run_id: str) -> Run:
    with factory() as s:
        found = s.get(Run, run_id)
        assert found is not None
        return found


def _age_s(beat: datetime | None) -> float:
    return (utcnow() - beat).total_seconds() if beat is not None else float("inf")


def test_a_stopped_supervisor_ends_its_run_within_stale_after_s(setup: dict[str, Any]) -> None:
    factory: sessionmaker[Session] = setup["factory"]
    home: Path = setup["home"]
    workload = {
        "num_requests": 5000,  # far more than either measures in the test
        "concurrency": 4,
        "prefix_tokens": 32,
        "output_tokens": 8,
        "warmup_requests": 2,
    }
    with factory() as s:
        exp = make_experiment(
            s, n_runs=2, model_path=str(setup["model"]), workload=workload, engine_args={}
        )
        for i, r in enumerate(exp.runs):
            r.explicit_engine_args = {}
            r.server_key = f"k{i}"  # two servers side by side
        stopped_id, other_id = (r.id for r in sorted(exp.runs, key=lambda r: r.sequence))
        s.commit()
    home.mkdir()
    settings = Settings(
        home=home,
        engine=EngineSettings(python=setup["engine_python"], startup_timeout_s=60),
        orchestrator=OrchestratorSettings(
            poll_interval_s=TICK_S, max_concurrent_runs=2, stale_after_s=STALE_AFTER_S
        ),
    )
    dispatcher = TimedDispatcher(settings, factory, RayRunBackend(settings))
    dispatcher.ticks = []
    stop = threading.Event()
    thread = threading.Thread(target=dispatcher.run_forever, args=(stop,), daemon=True)
    thread.start()
    supervisor: int | None = None
    supervisor_start: int | None = None
    try:

        def measuring() -> bool:
            with factory() as s:
                repo = RunRepository(s)
                return (
                    repo.count_requests(stopped_id) >= 30
                    and repo.count_samples(stopped_id) >= 2
                    and repo.count_requests(other_id) >= 10
                )

        _wait("both runs measuring", 180, measuring)
        engines = engine_processes(str(home.resolve()))
        owners = {
            int(info["owner_pid"])
            for info in engines.values()
            if info["run_id"] == stopped_id and info["owner_pid"]
        }
        assert len(owners) == 1, engines
        supervisor = owners.pop()
        supervisor_start = process_start_time(supervisor)
        assert "RunSupervisor" in process_title(supervisor), process_title(supervisor)
        with factory() as s:
            repo = RunRepository(s)
            streamed_at_stop = repo.count_requests(stopped_id)
            other_at_stop = repo.count_requests(other_id)
        os.kill(supervisor, signal.SIGSTOP)
        stopped = time.monotonic()

        # while it is stopped: the other run's heartbeat stays fresh (its ticks go on)
        other_ages: list[float] = []

        def ended() -> Run | None:
            other_ages.append(_age_s(_run(factory, other_id).heartbeat_at))
            found = _run(factory, stopped_id)
            return found if is_terminal(found.status) else None

        bound = STALE_AFTER_S + CALL_TIMEOUT_S + 2 * TICK_S + SLACK_S
        run = _wait("the stopped supervisor's run ends", bound + 30, ended)
        took = time.monotonic() - stopped
        _wait(
            "the stopped supervisor gone",
            10,
            lambda: not process_alive(supervisor or 0, supervisor_start),
        )
        gone_s = time.monotonic() - stopped
        _wait(
            "no engine process of the stopped run left",
            5,
            lambda: (
                not any(
                    i["run_id"] == stopped_id
                    for i in engine_processes(str(home.resolve())).values()
                )
            ),
        )
        other = _run(factory, other_id)
        with factory() as s:
            other_streamed = RunRepository(s).count_requests(other_id)
        ticks = [d for t0, d in dispatcher.ticks if stopped <= t0 <= stopped + took]
    finally:
        if supervisor is not None and process_alive(supervisor, supervisor_start):
            os.kill(supervisor, signal.SIGCONT)
            os.kill(supervisor, signal.SIGKILL)
        stop.set()
        thread.join(timeout=120)

    journal = read_journal(Path(run.engine_info["log_path"]))
    journaled = journal.records.get(stopped_id, {})
    with factory() as s:
        repo = RunRepository(s)
        rows = {r.seq: r for r in repo.request_rows(stopped_id)}
        samples = repo.count_samples(stopped_id)
    slow = [round(d, 2) for d in ticks if d >= CALL_TIMEOUT_S]
    print(
        f"\nsupervisor SIGSTOP (stale_after_s {STALE_AFTER_S:g} s, tick {TICK_S:g} s): run "
        f"{run.status} in {took:.2f} s (bound {bound:.1f} s), supervisor gone "
        f"{gone_s:.2f} s after the stop; request records {streamed_at_stop} in the database "
        f"at the stop, {len(journaled)} in the journal, {len(rows)} kept; samples {samples}; "
        f"error: {run.error!r}; the other run: heartbeat age at most "
        f"{max(other_ages):.2f} s, {other_at_stop} -> {other_streamed} records streamed, "
        f"{len(ticks)} ticks, longest {max(ticks):.2f} s, {len(slow)} of >= "
        f"{CALL_TIMEOUT_S:g} s {slow}"
    )
    assert run.status == "failed" and run.partial is True
    error = run.error or ""
    assert "the run supervisor did not answer for" in error and "(stopped or hung" in error
    assert "are kept" in error
    # bounded by the setting: stale_after_s from its last answer, a call, a tick
    assert took < bound
    # every record that reached durability, none twice
    assert len(rows) >= streamed_at_stop and len(rows) >= len(journaled) > 0
    assert set(rows) == set(range(len(rows)))
    assert samples >= 2
    # the silent supervisor held up one tick by one call at most; the other run went on
    assert len(slow) <= 1, ticks
    assert max(other_ages) < CALL_TIMEOUT_S + 2 * TICK_S + SLACK_S
    assert not is_terminal(other.status) or other.status == "succeeded", other.error
    assert other_streamed > other_at_stop
