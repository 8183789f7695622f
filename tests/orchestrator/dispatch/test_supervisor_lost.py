"""A run whose supervisor dies while the orchestrator lives keeps what it measured.

Without Ray or vLLM: real Postgres, the real dispatcher, a stub run backend whose poll
says what the Ray backend says when the supervisor's worker was killed (``kill -9``, an
out-of-memory kill): done, no result. The run's journal is written by the real
:class:`jobs.run.journal.Journal` where the runner writes it (beside the engine log).

- the request records and samples streamed every tick stay (they used to be replaced
  by nothing), the journal adds those the stream had not delivered (none twice), a torn
  last line is skipped with a note; the run ends failed, ``partial``, its engine log
  read from disk;
- while a run goes, samples are streamed every tick like records, counted only once
  committed;
- a supervisor that does not answer (the poll says ``answered=False``) gets no heartbeat
  for its run and is not asked for records or samples; when the backend gives up on it
  the run fails the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api.routes.runs import get_run_log
from jobs.run.journal import Journal, journal_paths
from jobs.schemas import MetricSample, RequestRecord
from orchestrator.core.models import Run
from orchestrator.core.repositories import RunRepository
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus
from orchestrator.dispatch.dispatcher import Dispatcher, Poll
from tests.conftest import fresh_sessions
from tests.factories import make_experiment


class LostBackend:
    """A run backend whose poll says what the Ray backend says once the run's supervisor
    died; ``records``/``samples`` hand out what the test queued (the stream)."""

    resource = "CPU"

    def __init__(self) -> None:
        progress = {"phase": "measuring", "requests_done": 3, "requests_total": 40}
        self.poll_answer = Poll(done=False, progress=progress)
        self.new_records: dict[str, list[dict[str, Any]]] = {}
        self.new_samples: dict[str, list[dict[str, Any]]] | Exception = {}
        self.released: list[str] = []
        #: the stream's calls, in order ("records", "samples")
        self.asked: list[str] = []

    def resources(self) -> dict[str, float]:
        return {"CPU": 2.0}

    def nodes(self) -> list[Any]:
        return []

    def poll(self, run_id: str) -> Poll:
        return self.poll_answer

    def records(self, run_id: str, since: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        self.asked.append("records")
        new, self.new_records = self.new_records, {}
        return new

    def samples(self, run_id: str, since: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        self.asked.append("samples")
        if isinstance(self.new_samples, Exception):
            raise self.new_samples
        new, self.new_samples = self.new_samples, {}
        return new

    def cancel(self, run_id: str) -> None:
        pass

    def attach(self, run_id: str) -> bool:
        return False

    def release(self, run_id: str) -> None:
        self.released.append(run_id)


@pytest.fixture
def factory(server_url: str) -> Iterator[sessionmaker[Session]]:
    """A migrated database of this test's own."""
    with fresh_sessions(server_url) as sessions:
        yield sessions


def _record(index: int, *, warmup: bool = False, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        index=index,
        warmup=warmup,
        request_class="short",
        success=ok,
        error=None if ok else "HTTP 500: boom",
        start_s=1.0 + index,
        ttft_s=0.1 if ok else None,
        tpot_s=0.01 if ok else None,
        e2el_s=0.17 if ok else None,
        itl_s=[0.01] * 7 if ok else [],
        prompt_tokens=100,
        output_tokens=8 if ok else None,
    )


def _sample(t_s: float) -> MetricSample:
    return MetricSample(t_s=t_s, phase="during", values={"num_requests_running": 1.0})


def _running(factory: sessionmaker[Session], log_path: Path) -> str:
    with factory() as s:
        run = make_experiment(s, n_runs=1).runs[0]
        repo = RunRepository(s)
        repo.transition(run, RunStatus.PREPARING)
        repo.transition(run, RunStatus.RUNNING)
        run.claimed_by = "me"
        run.engine_info = {"log_path": str(log_path)}
        run.progress = {"phase": "measuring", "requests_done": 3, "requests_total": 40}
        s.commit()
        return run.id


def _dispatcher(factory: sessionmaker[Session], tmp_path: Path, backend: LostBackend) -> Dispatcher:
    dispatcher = Dispatcher(Settings(home=tmp_path / "home"), factory, backend)  # type: ignore[arg-type]
    return dispatcher


def test_supervisor_death_keeps_streamed_and_journaled_records_samples_and_log(
    factory: sessionmaker[Session], tmp_path: Path
) -> None:
    log_path = tmp_path / "runs" / "r1" / "engine.log"
    log_path.parent.mkdir(parents=True)
    log_path.write_text("INFO vLLM API server version 0.0.0\nINFO 200 OK\n" * 40)
    run_id = _running(factory, log_path)
    backend = LostBackend()
    dispatcher = _dispatcher(factory, tmp_path, backend)
    dispatcher.active[run_id] = [run_id]

    # what the runner took, in order: a warm-up and 5 measured records, 4 samples
    records = [_record(0, warmup=True), *(_record(i) for i in range(1, 5)), _record(5, ok=False)]
    samples = [_sample(float(t)) for t in range(4)]
    journal = Journal(log_path)
    for r in records:
        journal.record(run_id, r)
    for smp in samples:
        journal.sample(run_id, smp)
    journal.record("another-run-of-the-batch", _record(0))
    journal.close()
    records_path, _ = journal_paths(log_path)
    with records_path.open("ab") as fh:  # the supervisor died mid-line
        fh.write(b'{"run_id":"' + run_id.encode() + b'","seq":6,"record":{"ind')

    # two ticks streamed the first 4 records and 2 samples
    backend.new_records = {run_id: [r.model_dump() for r in records[:2]]}
    backend.new_samples = {run_id: [smp.model_dump() for smp in samples[:1]]}
    dispatcher.tick()
    backend.new_records = {run_id: [r.model_dump() for r in records[2:4]]}
    backend.new_samples = {run_id: [smp.model_dump() for smp in samples[1:2]]}
    dispatcher.tick()
    assert (dispatcher.streamed[run_id], dispatcher.streamed_samples[run_id]) == (4, 2)

    # the supervisor's worker is killed: the backend's poll is done without a result
    backend.poll_answer = Poll(done=True, error="run supervisor died: ActorDiedError: ...")
    dispatcher.tick()

    assert backend.released == [run_id] and run_id not in dispatcher.active
    with factory() as s:
        run = s.get(Run, run_id)
        assert run is not None
        repo = RunRepository(s)
        assert run.status == "failed" and run.partial is True
        assert (run.error or "").startswith("run supervisor died")
        assert "the 5 measured requests it had recorded (4 succeeded) are kept" in (run.error or "")
        rows = repo.request_rows(run_id)
        assert [(r.seq, r.request_index, r.warmup) for r in rows] == [
            (i, r.index, r.warmup) for i, r in enumerate(records)
        ]
        assert [smp.t_s for smp in repo.samples(run_id)] == [0.0, 1.0, 2.0, 3.0]
        assert repo.metrics(run_id)["completed"] == 4
        assert repo.log(run_id) == log_path.read_text()
        body = get_run_log(run_id, s, raw=True).body
        assert body == log_path.read_bytes()
        recovered = run.engine_info["recovered"]
        assert (recovered["requests"], recovered["samples"]) == (6, 4)
        assert (recovered["journal"]["records"], recovered["journal"]["samples"]) == (2, 2)
        assert any("torn last line skipped" in n for n in recovered["journal"]["notes"])
        assert run.engine_info["log_path"] == str(log_path)
        assert (run.progress["requests_done"], run.progress["requests_total"]) == (5, 40)


def test_supervisor_death_without_a_journal_keeps_the_streamed_rows(
    factory: sessionmaker[Session], tmp_path: Path
) -> None:
    """The run's first node was another machine: no journal here, the stream is kept."""
    run_id = _running(factory, tmp_path / "elsewhere" / "engine.log")
    backend = LostBackend()
    dispatcher = _dispatcher(factory, tmp_path, backend)
    dispatcher.active[run_id] = [run_id]
    backend.new_records = {run_id: [_record(1).model_dump(), _record(2, ok=False).model_dump()]}
    dispatcher.tick()
    backend.poll_answer = Poll(done=True, error="ray error: OutOfMemoryError: ...")
    dispatcher.tick()
    with factory() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.status == "failed" and run.partial is True
        assert RunRepository(s).count_requests(run_id) == 2
        assert RunRepository(s).log(run_id) is None  # nothing on disk to keep
        assert run.engine_info["recovered"]["journal"]["records"] == 0


def test_samples_are_streamed_every_tick_and_a_failed_fetch_streams_them_later(
    factory: sessionmaker[Session], tmp_path: Path
) -> None:
    run_id = _running(factory, tmp_path / "engine.log")
    backend = LostBackend()
    dispatcher = _dispatcher(factory, tmp_path, backend)
    dispatcher.active[run_id] = [run_id]
    backend.new_records = {run_id: [_record(1).model_dump()]}
    backend.new_samples = RuntimeError("supervisor busy")  # this tick's samples fail
    dispatcher.tick()
    assert (dispatcher.streamed[run_id], dispatcher.streamed_samples.get(run_id, 0)) == (1, 0)
    backend.new_samples = {run_id: [_sample(0.0).model_dump(), _sample(1.0).model_dump()]}
    dispatcher.tick()
    assert dispatcher.streamed_samples[run_id] == 2
    with factory() as s:
        assert [smp.t_s for smp in RunRepository(s).samples(run_id)] == [0.0, 1.0]
        assert RunRepository(s).count_requests(run_id) == 1


def test_a_silent_supervisor_gets_no_heartbeat_and_no_stream_then_ends_failed(
    factory: sessionmaker[Session], tmp_path: Path
) -> None:
    """A supervisor that does not answer (SIGSTOP, a hang): while it is silent its run's
    heartbeat is not renewed and neither records nor samples are asked for; when the
    backend gives up on it (``stale_after_s`` without an answer) the run fails keeping
    what was streamed, like a killed one."""
    run_id = _running(factory, tmp_path / "engine.log")
    backend = LostBackend()
    asked = backend.asked
    dispatcher = _dispatcher(factory, tmp_path, backend)
    dispatcher.active[run_id] = [run_id]
    backend.new_records = {run_id: [_record(1).model_dump(), _record(2).model_dump()]}
    dispatcher.tick()
    assert asked == ["records", "samples"]
    with factory() as s:
        found = s.get(Run, run_id)
        assert found is not None and found.heartbeat_at is not None
        beat = found.heartbeat_at

    asked.clear()
    backend.poll_answer = Poll(done=False, answered=False)
    for _ in range(3):
        dispatcher.tick()
    assert asked == []
    with factory() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.heartbeat_at == beat and run.status == "running"

    error = "the run supervisor did not answer for 15 s (stopped or hung); ended"
    backend.poll_answer = Poll(done=True, error=error)
    dispatcher.tick()
    assert backend.released == [run_id] and run_id not in dispatcher.active
    with factory() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.status == "failed" and run.partial is True
        assert (run.error or "").startswith(error) and "are kept" in (run.error or "")
        assert RunRepository(s).count_requests(run_id) == 2
