"""Repositories against a real Postgres: claiming, transitions, measurements."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, update
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.db import unit_of_work
from orchestrator.core.models import Experiment, Run
from orchestrator.core.repositories import RunRepository
from orchestrator.core.states import RunStatus
from tests.factories import make_experiment


def test_claim_takes_oldest_queued_and_moves_it_to_preparing(db_session: Session) -> None:
    # other tests' committed queued runs are set aside inside this rolled-back transaction
    db_session.execute(update(Run).where(Run.status == "queued").values(status="cancelled"))
    exp = make_experiment(db_session, n_runs=3)
    repo = RunRepository(db_session)
    run = repo.claim_next_queued("orch-a")
    assert run is not None
    assert run.experiment_id == exp.id and run.position == 0
    assert run.status == "preparing" and run.claimed_by == "orch-a"
    assert run.claimed_at is not None


def test_two_orchestrators_never_claim_the_same_run(
    session_factory: sessionmaker[Session],
) -> None:
    with unit_of_work(session_factory) as s:
        exp_ids = [make_experiment(s, n_runs=5).id for _ in range(2)]
    claimed: dict[str, list[str]] = {"a": [], "b": []}
    barrier = threading.Barrier(2)

    def worker(name: str) -> None:
        barrier.wait()
        while True:
            with unit_of_work(session_factory) as s:
                run = RunRepository(s).claim_next_queued(name)
                if run is None:
                    return
                if run.experiment_id in exp_ids:
                    claimed[name].append(run.id)

    threads = [threading.Thread(target=worker, args=(n,)) for n in claimed]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        all_ids = claimed["a"] + claimed["b"]
        assert len(all_ids) == 10
        assert len(set(all_ids)) == 10
    finally:
        with unit_of_work(session_factory) as s:
            s.execute(delete(Experiment).where(Experiment.id.in_(exp_ids)))


def test_save_measurements_replaces_and_reads_back(db_session: Session) -> None:
    exp = make_experiment(db_session, n_runs=1)
    run = exp.runs[0]
    repo = RunRepository(db_session)
    for attempt in range(2):
        repo.save_measurements(
            run.id,
            metrics={"median_ttft_ms": 10.0 + attempt, "completed": 4.0},
            samples=[{"t_s": 0.0, "phase": "before", "values": {"prefix_cache_hits": 0.0}}],
            requests=[
                {
                    "index": 0,
                    "warmup": False,
                    "success": True,
                    "start_s": 0.1,
                    "ttft_s": 0.01,
                    "itl_s": [0.001, 0.002],
                    "e2el_s": 0.02,
                    "tpot_s": 0.0015,
                    "prompt_tokens": 100,
                    "output_tokens": 3,
                }
            ],
            engine_log="INFO hello\x00\n",
        )
    assert repo.metrics(run.id) == {"median_ttft_ms": 11.0, "completed": 4.0}
    assert len(repo.samples(run.id)) == 1
    rows, total = repo.requests(run.id, limit=10, offset=0)
    assert total == 1 and rows[0].itl_s == [0.001, 0.002]
    assert repo.log(run.id) == "INFO hello\n"


def test_transition_sets_timestamps(db_session: Session) -> None:
    run = make_experiment(db_session, n_runs=1).runs[0]
    repo = RunRepository(db_session)
    repo.transition(run, RunStatus.PREPARING)
    repo.transition(run, RunStatus.RUNNING)
    assert run.started_at is not None and run.finished_at is None
    repo.transition(run, RunStatus.FAILED, "boom")
    assert run.finished_at is not None and run.status_reason == "boom"


def test_newest_gpu_memory_is_the_smallest_gpu_of_the_newest_succeeded_gpu_run(
    db_session: Session,
) -> None:
    """Among the newest runs: a failed GPU run and a newer CPU run are passed over; the
    newest succeeded GPU run with GPUs recorded gives its smallest GPU's memory."""
    runs = make_experiment(db_session, n_runs=4).runs
    later = datetime.now(UTC) + timedelta(days=30)

    def gpus(*mib: int) -> dict[str, object]:
        return {"gpu_assignment": [{"gpus": [{"memory_total_mib": m} for m in mib]}]}

    shapes = [
        ("succeeded", "GPU", gpus(40960)),  # older
        ("succeeded", "GPU", gpus(81559, 40960 * 2)),  # the answer
        ("failed", "GPU", gpus(1024)),
        ("succeeded", "CPU", {}),
    ]
    for i, (run, (status, resource, info)) in enumerate(zip(runs, shapes, strict=True)):
        run.status, run.placement, run.engine_info = status, {"resource": resource}, info
        run.created_at = later + timedelta(minutes=i)
    db_session.flush()
    assert RunRepository(db_session).newest_gpu_memory() == (runs[1].id, 81559.0)
    runs[1].engine_info = {"gpu_assignment": [{"gpus": [{"memory_total_mib": None}]}]}
    db_session.flush()
    assert RunRepository(db_session).newest_gpu_memory() == (runs[0].id, 40960.0)
