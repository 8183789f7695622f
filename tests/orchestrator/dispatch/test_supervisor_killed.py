"""``kill -9`` of a run's supervisor (the Ray worker of ``ray::RunSupervisor``) while the
run measures: the run fails at once, ``partial``, with every request record and sample
that reached durability (streamed to the database, or in the run's journal on disk),
and ``/log`` serves the engine log from disk.

Real Postgres, real Ray (a local node), the real dispatcher, backend, supervisor and
runner. The engine is a TEST DOUBLE launched the way runs launch vLLM (the engine
python ``VLAB_ENGINE__PYTHON`` runs ``jobs/launcher/vllm_launcher.py serve ...``): it loads the
real launcher (its lifetime guard ends the engine when its owner, the supervisor, is
gone) and serves the OpenAI API with the project's stub server (:mod:`jobs.stub.stubserver`,
vLLM's metric names on ``/metrics``). The real vLLM adds nothing here: what is under
test is what happens to the measurements when the process that took them dies.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api.routes.runs import get_run_log
from jobs.engine.processes import engine_processes, process_title
from jobs.run.journal import read_journal
from orchestrator.core.models import Run
from orchestrator.core.repositories import RunRepository
from orchestrator.core.settings import EngineSettings, OrchestratorSettings, Settings
from orchestrator.core.states import is_terminal
from orchestrator.dispatch.dispatcher import Dispatcher
from orchestrator.dispatch.ray.backend import RayRunBackend
from tests.conftest import REPO
from tests.factories import make_experiment
from tests.orchestrator.dispatch.raydb import ray_and_database

STUB_ENGINE = """\
#!{python}
# TEST DOUBLE for the engine venv's python: the real launcher (its lifetime guard),
# then the project's stub server in place of vLLM.
import importlib.util, signal, sys, threading
sys.path.insert(0, {repo!r})
argv = sys.argv
spec = importlib.util.spec_from_file_location("vllm_launcher", argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
from jobs.stub.stubserver import StubServer
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
print("INFO stub engine (test double) starting", flush=True)
port = int(argv[argv.index("--port") + 1])
with StubServer(0.02, 0.005, "127.0.0.1", port, model="tiny"):
    print("INFO Application startup complete.", flush=True)
    stop.wait()
print("INFO stub engine stopped", flush=True)
"""

#: Poll interval of the dispatcher: the stream's tick, as in production (the default).
TICK_S = 1.0


@pytest.fixture
def setup(tmp_path: Path, server_url: str) -> Iterator[dict[str, Any]]:
    with ray_and_database(
        tmp_path, server_url, STUB_ENGINE.format(python=sys.executable, repo=str(REPO))
    ) as found:
        yield found


def _wait(what: str, timeout_s: float, check: Any) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def _start(setup: dict[str, Any], requests: int) -> tuple[str, threading.Event, threading.Thread]:
    """A queued run of ``requests`` measured requests and a dispatcher thread running it."""
    factory: sessionmaker[Session] = setup["factory"]
    workload = {
        "num_requests": requests,
        "concurrency": 4,
        "prefix_tokens": 32,
        "output_tokens": 8,
        "warmup_requests": 2,
    }
    with factory() as s:
        exp = make_experiment(
            s, n_runs=1, model_path=str(setup["model"]), workload=workload, engine_args={}
        )
        run = exp.runs[0]
        run.explicit_engine_args = {}
        run_id = run.id
        s.commit()
    home: Path = setup["home"]
    home.mkdir()
    settings = Settings(
        home=home,
        engine=EngineSettings(python=setup["engine_python"], startup_timeout_s=60),
        orchestrator=OrchestratorSettings(poll_interval_s=TICK_S),
    )
    dispatcher = Dispatcher(settings, factory, RayRunBackend(settings))
    stop = threading.Event()
    thread = threading.Thread(target=dispatcher.run_forever, args=(stop,), daemon=True)
    thread.start()
    return run_id, stop, thread


def _ended(factory: sessionmaker[Session], run_id: str) -> Run | None:
    with factory() as s:
        found = s.get(Run, run_id)
        return found if found is not None and is_terminal(found.status) else None


def test_kill_9_of_the_supervisor_keeps_what_the_run_measured(setup: dict[str, Any]) -> None:
    factory: sessionmaker[Session] = setup["factory"]
    home: Path = setup["home"]
    run_id, stop, thread = _start(setup, 5000)  # far more than it measures before the kill
    try:

        def measuring() -> bool:
            with factory() as s:
                repo = RunRepository(s)
                return repo.count_requests(run_id) >= 30 and repo.count_samples(run_id) >= 2

        _wait("30 request records and 2 samples streamed", 120, measuring)
        engines = engine_processes(str(home.resolve()))
        owners = {int(info["owner_pid"]) for info in engines.values() if info["owner_pid"]}
        assert len(owners) == 1, engines
        supervisor = owners.pop()
        assert "RunSupervisor" in process_title(supervisor), process_title(supervisor)
        with factory() as s:
            streamed_at_kill = RunRepository(s).count_requests(run_id)
        os.kill(supervisor, signal.SIGKILL)
        killed = time.monotonic()

        run = _wait("the run ends", 30, lambda: _ended(factory, run_id))
        took = time.monotonic() - killed
        _wait("no engine process left", 10, lambda: not engine_processes(str(home.resolve())))
    finally:
        stop.set()
        thread.join(timeout=120)

    log_path = Path(run.engine_info["log_path"])
    journal = read_journal(log_path)
    journaled = journal.records.get(run_id, {})
    with factory() as s:
        repo = RunRepository(s)
        rows = {r.seq: r for r in repo.request_rows(run_id)}
        samples = repo.count_samples(run_id)
        body = get_run_log(run_id, s, raw=True).body
    print(
        f"\nsupervisor kill -9: run {run.status} in {took:.2f} s, partial={run.partial}; "
        f"request records: {streamed_at_kill} in the database at the kill, "
        f"{len(journaled)} in the journal, {len(rows)} kept; samples: "
        f"{len(journal.samples.get(run_id, {}))} in the journal, {samples} kept; "
        f"journal notes: {journal.notes}; log {len(body)} bytes"
    )
    assert run.status == "failed" and run.partial is True
    assert "run supervisor died" in (run.error or "") and "are kept" in (run.error or "")
    # the dispatcher sees the death on its next poll: a tick and the poll's own time
    assert took < 2 * TICK_S + 5
    # every record that reached durability, none twice: the stream's and the journal's
    assert len(rows) >= streamed_at_kill and len(rows) >= len(journaled) > 0
    assert set(rows) == set(range(len(rows)))
    for seq, record in journaled.items():
        assert rows[seq].request_index == record["index"]
        assert rows[seq].warmup == record["warmup"]
    assert samples >= max(2, len(journal.samples.get(run_id, {})))
    assert run.engine_info["recovered"]["requests"] == len(rows)
    # /log serves the engine log from disk
    assert body and body == log_path.read_bytes()


def test_a_run_that_ends_keeps_its_final_lists_once(setup: dict[str, Any]) -> None:
    """Streamed samples and records are replaced by the run's final lists: none twice."""
    factory: sessionmaker[Session] = setup["factory"]
    run_id, stop, thread = _start(setup, 120)
    try:
        run = _wait("the run ends", 120, lambda: _ended(factory, run_id))
    finally:
        stop.set()
        thread.join(timeout=120)
    assert run.status == "succeeded", run.error
    # the final result's engine_info replaces the launch's note of the log path
    journal = read_journal(Settings(home=setup["home"]).runs_dir / run_id / "engine.log")
    with factory() as s:
        repo = RunRepository(s)
        assert repo.count_requests(run_id) == len(journal.records[run_id]) == 122
        assert repo.count_samples(run_id) == len(journal.samples[run_id]) >= 3
