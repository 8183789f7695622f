"""No orphans, without vLLM or Ray: what a restarted orchestrator does before it starts
anything (:meth:`orchestrator.dispatch.dispatcher.Dispatcher.startup`).

- the runs of an orchestrator of the same ``VLAB_HOME`` that died (its lock file is
  free) are failed at once, not after their heartbeat goes stale, keeping the request
  records streamed while they ran, their metrics and their engine log (read from disk);
- engine processes this home started and no live run owns are killed; another home's,
  and those of a run another live orchestrator holds, are left alone.

Real Postgres; the run backend is a stub (no supervisor can be re-attached), the
"engines" are ``sleep`` processes carrying the markers real engines carry.
"""

from __future__ import annotations

import fcntl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from jobs.engine.processes import HOME_ENV, RUN_ID_ENV
from orchestrator.core.models import Run, RunLog, RunMetric, RunRequest
from orchestrator.core.repositories import OrchestratorRepository, RunRepository
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus
from orchestrator.dispatch.dispatcher import Dispatcher
from orchestrator.runs.logs import engine_log_from_disk
from tests.conftest import fresh_sessions
from tests.factories import make_experiment


class StubBackend:
    """A run backend whose supervisors are all gone (nothing can be re-attached)."""

    resource = "CPU"

    def resources(self) -> dict[str, float]:
        return {"CPU": 2.0}

    def nodes(self) -> list[Any]:
        return []

    def attach(self, run_id: str) -> bool:
        return False


@pytest.fixture
def factory(server_url: str) -> Iterator[sessionmaker[Session]]:
    """A migrated database of this test's own."""
    with fresh_sessions(server_url) as sessions:
        yield sessions


def _running_run(s: Session, claimed_by: str, **fields: Any) -> Run:
    run = make_experiment(s, n_runs=1).runs[0]
    repo = RunRepository(s)
    repo.transition(run, RunStatus.PREPARING)
    repo.transition(run, RunStatus.RUNNING)
    run.claimed_by = claimed_by
    repo.heartbeat(run.id, None)
    for key, value in fields.items():
        setattr(run, key, value)
    s.flush()
    return run


def _record(index: int, *, warmup: bool = False, ok: bool = True) -> dict[str, Any]:
    base: dict[str, Any] = {
        "index": index,
        "warmup": warmup,
        "request_class": "short",
        "success": ok,
        "error": None if ok else "HTTP 500: boom",
        "start_s": 1.0 + index,
        "itl_s": [0.01] * 7 if ok else [],
    }
    if ok:
        base.update(ttft_s=0.1, tpot_s=0.01, e2el_s=0.17, prompt_tokens=100, output_tokens=8)
    return base


def test_restart_fails_a_dead_predecessors_run_keeping_what_it_measured(
    factory: sessionmaker[Session], tmp_path: Path
) -> None:
    home = tmp_path / "home"
    (home / "orchestrators").mkdir(parents=True)
    dead, alive = "host-dead0001", "host-live0001"
    (home / "orchestrators" / f"{dead}.lock").touch()  # nobody holds it: that one died
    live_lock = (home / "orchestrators" / f"{alive}.lock").open("a+")
    fcntl.flock(live_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live orchestrator of this home
    log_file = tmp_path / "runs" / "x" / "engine.log"
    log_file.parent.mkdir(parents=True)
    log_file.write_text("# vlab: serve\nINFO engine started\n")
    with factory() as s:
        for oid in (dead, alive):  # both heartbeats are fresh: no staleness to wait for
            OrchestratorRepository(s).heartbeat(oid, "host", {})
        lost = _running_run(
            s,
            dead,
            progress={"phase": "measuring", "requests_done": 4, "requests_total": 10},
            engine_info={"log_path": str(log_file)},
        )
        kept = _running_run(s, alive)
        rows = [_record(0, warmup=True), _record(1), _record(2), _record(3), _record(4, ok=False)]
        RunRepository(s).append_requests(lost.id, 0, rows[:3])  # streamed on two ticks
        RunRepository(s).append_requests(lost.id, 3, rows[3:])
        s.commit()
        lost_id, kept_id = lost.id, kept.id
    # while it runs, the log is served from disk
    assert engine_log_from_disk(lost) == log_file.read_text()

    settings = Settings(home=home)
    dispatcher = Dispatcher(settings, factory, StubBackend())  # type: ignore[arg-type]
    try:
        dispatcher.startup()
        with factory() as s:
            run = s.get(Run, lost_id)
            other = s.get(Run, kept_id)
            assert run is not None and other is not None
            assert run.status == "failed" and run.partial is True
            assert dead in (run.error or "") and "died" in (run.error or "")
            assert "the 4 measured requests it had recorded (3 succeeded) are kept" in (
                run.error or ""
            )
            assert (run.progress["requests_done"], run.progress["requests_total"]) == (4, 10)
            n = s.scalar(
                select(func.count()).select_from(RunRequest).where(RunRequest.run_id == lost_id)
            )
            assert n == 5
            metrics = dict(
                s.execute(
                    select(RunMetric.name, RunMetric.value).where(RunMetric.run_id == lost_id)
                ).all()
            )
            assert (metrics["completed"], metrics["failed"]) == (3, 1)
            assert metrics["mean_ttft_ms"] == pytest.approx(100.0)
            assert s.scalar(select(RunLog.content).where(RunLog.run_id == lost_id)) == (
                log_file.read_text()
            )
            assert other.status == "running"  # a live orchestrator's run is not touched
        assert not (home / "orchestrators" / f"{dead}.lock").exists()
        assert (home / "orchestrators" / f"{dispatcher.orchestrator_id}.lock").exists()
    finally:
        live_lock.close()


def test_sweep_ends_only_this_homes_orphans(factory: sessionmaker[Session], tmp_path: Path) -> None:
    home, other_home = tmp_path / "home", tmp_path / "other-home"
    home.mkdir()
    with factory() as s:
        OrchestratorRepository(s).heartbeat("host-live0002", "host", {})
        held = _running_run(s, "host-live0002")
        s.commit()
        held_id = held.id

    def fake_engine(run_id: str, engine_home: Path) -> subprocess.Popen[bytes]:
        env = {RUN_ID_ENV: run_id, HOME_ENV: str(engine_home.resolve()), "PATH": "/usr/bin:/bin"}
        return subprocess.Popen(["sleep", "600"], env=env, start_new_session=True)

    orphan = fake_engine("run-of-a-dead-service", home)
    other = fake_engine("run-of-a-dead-service", other_home)  # another home's: not ours
    owned = fake_engine(held_id, home)  # a live orchestrator of this home runs it
    try:
        dispatcher = Dispatcher(Settings(home=home), factory, StubBackend())  # type: ignore[arg-type]
        dispatcher.startup()
        assert orphan.wait(timeout=10) == -9
        assert other.poll() is None
        assert owned.poll() is None
    finally:
        for p in (orphan, other, owned):
            p.kill()
            p.wait()
