"""Storing a finished run's result: final progress counters and the stored diagnostics."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session

from jobs.schemas import RequestRecord, RunResult
from orchestrator.core.states import RunStatus
from orchestrator.runs.service import record_result
from tests.factories import make_experiment


def _records(n: int, warmups: int) -> list[RequestRecord]:
    return [
        RequestRecord(index=i - warmups, warmup=i < warmups, success=True, start_s=0.1 * i)
        for i in range(n + warmups)
    ]


def test_final_progress_counts_the_measured_requests(db_session: Session) -> None:
    exp = make_experiment(db_session, n_runs=2)
    failed, ok = sorted(exp.runs, key=lambda r: r.position)  # ok: prefix caching on
    for r in (ok, failed):
        r.status = RunStatus.RUNNING.value
        # the last heartbeat before the end: stale counters of an earlier phase
        r.progress = {"phase": "warmup", "requests_done": 0, "requests_total": 1}
    record_result(
        db_session, ok, RunResult(run_id=ok.id, status="succeeded", requests=_records(8, 1))
    )
    assert ok.progress == {
        "phase": "done",
        "message": "succeeded",
        "requests_done": 8,
        "requests_total": 8,
    }
    # a run that failed part-way keeps its planned total, with what was measured done
    failed.progress = {"phase": "measuring", "requests_done": 2, "requests_total": 8}
    record_result(
        db_session,
        failed,
        RunResult(run_id=failed.id, status="failed", error="boom", requests=_records(3, 1)),
    )
    assert (failed.progress["requests_done"], failed.progress["requests_total"]) == (3, 8)
    # the model path does not exist: no KV check; the prefix analysis records why it is
    # missing instead of failing the result (prefix caching off: no analysis at all)
    assert "kv_cache_check" not in ok.engine_info
    assert "FileNotFoundError" in ok.engine_info["prefix_analysis"]["error"]
    assert "prefix_analysis" not in failed.engine_info


def test_a_run_no_poll_saw_measuring_started_when_its_warmup_began(db_session: Session) -> None:
    """A short run ends before any poll sees it measuring: its start is its warm-up's, by
    the supervisor's timings, not the moment its result is stored (a fresh-user trial saw
    campaign runs of 27 s shown as 0.0 s long)."""
    (run,) = make_experiment(db_session, n_runs=1).runs
    run.status = RunStatus.PREPARING.value
    run.claimed_at = datetime.now(UTC) - timedelta(seconds=30)
    timings = {"startup_s": 25.0, "warmup_s": 0.5, "measure_s": 1.0, "stop_s": 0.3}
    record_result(
        db_session,
        run,
        RunResult(run_id=run.id, status="succeeded", requests=_records(4, 1), timings=timings),
    )
    assert run.status == "succeeded" and run.started_at and run.finished_at
    ran = (run.finished_at - run.started_at).total_seconds()
    assert 1.8 <= ran < 2.5, ran
    assert run.started_at >= run.claimed_at
