"""``GET /api/v1/experiments/{id}/export``, streamed: the bytes and headers of the export
built whole in memory (as before), in memory that does not grow with the number of
runs, and a database error before the first byte is still a 503 problem."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.analysis.export import runs_table, to_csv_bytes, to_parquet_bytes
from orchestrator.analysis.service import export_file
from orchestrator.core.models import Experiment, RunMetric
from orchestrator.core.repositories import HistoryRepository, RunRepository
from orchestrator.experiments.service import get_experiment
from tests.factories import make_experiment
from tests.web.seed import bulk_history_sql

PROBLEM = "application/problem+json"


def whole_export(session: Session, experiment_id: str, fmt: str) -> bytes:
    """The export as it was built before it was streamed (the whole table in memory)."""
    exp = get_experiment(session, experiment_id)
    runs = list(exp.runs)
    metrics = RunRepository(session).metrics_for([r.id for r in runs])
    rows = [
        {
            "id": r.id,
            "experiment_id": r.experiment_id,
            "variant": r.name,
            "repeat_index": r.repeat_index,
            "sequence": r.sequence,
            "status": r.status,
            "started_at": r.started_at,
            "finished_at": r.finished_at,
            "model_id": r.model_id,
            "model_digest": r.model_digest,
            "max_model_len": r.max_model_len,
            "request_list_hash": r.request_list_hash,
            "vllm_version": r.vllm_version,
            "layout": r.layout,
            "workload": r.workload,
            "engine_args": r.explicit_engine_args,
            "metrics": metrics.get(r.id, {}),
        }
        for r in runs
    ]
    df = runs_table(rows)
    return to_parquet_bytes(df) if fmt == "parquet" else to_csv_bytes(df)


@pytest.fixture
def small(session_factory: sessionmaker[Session]) -> str:
    """An experiment of five runs whose columns differ: two finished with metrics (one
    with an extra one), one running, an engine argument of two types."""
    t0 = datetime(2026, 5, 1, 9, 30, 15, 123456, tzinfo=UTC)
    with session_factory.begin() as s:
        exp = make_experiment(s, n_runs=5)
        for i, run in enumerate(exp.runs):
            run.started_at = t0 + timedelta(minutes=i) if i < 4 else None
            run.finished_at = t0 + timedelta(minutes=i, seconds=40) if i < 2 else None
            run.status = "succeeded" if i < 2 else "running" if i < 4 else "queued"
            run.vllm_version = "0.32.0" if i < 2 else None
            run.explicit_engine_args = {"max_num_seqs": 8 if i % 2 else "auto"}
            if i < 2:
                s.add(RunMetric(run_id=run.id, name="median_ttft_ms", value=10.5 + i))
        s.add(RunMetric(run_id=exp.runs[1].id, name="p99_ttft_ms", value=99.0))
        return exp.id


@pytest.mark.parametrize(
    ("fmt", "media"),
    [("csv", "text/csv; charset=utf-8"), ("parquet", "application/vnd.apache.parquet")],
)
def test_the_streamed_export_is_the_whole_exports_bytes_and_headers(
    client: TestClient, session_factory: sessionmaker[Session], small: str, fmt: str, media: str
) -> None:
    with session_factory() as s:
        want = whole_export(s, small, fmt)
    got = client.get(f"/api/v1/experiments/{small}/export", params={"format": fmt})
    assert got.status_code == 200, got.text
    assert got.content == want
    assert got.headers["content-type"] == media
    assert got.headers["content-disposition"] == f'attachment; filename="{small}.{fmt}"'
    assert got.headers["content-length"] == str(len(want))


def test_an_unknown_experiment_is_still_a_404(client: TestClient) -> None:
    got = client.get("/api/v1/experiments/nope/export")
    assert got.status_code == 404
    assert got.headers["content-type"].startswith(PROBLEM)
    assert got.json()["code"] == "experiment_not_found"


def test_a_database_error_during_the_export_is_a_503_problem_not_a_cut_off_file(
    client: TestClient, small: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database goes away after the first batch of runs was read (and written)."""
    real = HistoryRepository.export_rows

    def lost(self: HistoryRepository, experiment_id: str, batch_size: int) -> Iterator[Any]:
        yield next(real(self, experiment_id, 2))
        raise OperationalError("FETCH FORWARD 2", {}, Exception("server closed the connection"))

    monkeypatch.setattr(HistoryRepository, "export_rows", lost)
    for fmt in ("csv", "parquet"):
        got = client.get(f"/api/v1/experiments/{small}/export", params={"format": fmt})
        assert got.status_code == 503, got.text
        assert got.headers["content-type"].startswith(PROBLEM)
        assert got.json()["code"] == "database_unavailable"
        assert "content-disposition" not in got.headers


def _seed_one(session_factory: sessionmaker[Session], runs: int, prefix: str) -> str:
    with session_factory.begin() as s:
        bulk_history_sql(
            s, experiments=1, runs_per_experiment=runs, model=f"{prefix}-model", name_prefix=prefix
        )
        return str(s.scalar(select(Experiment.id).where(Experiment.name == f"{prefix}-000-00000")))


def _peak(session_factory: sessionmaker[Session], experiment_id: str, fmt: str) -> tuple[int, int]:
    """(peak bytes Python allocated, runs in the file) of one export."""
    tracemalloc.start()
    try:
        with session_factory() as s:
            body, _ = export_file(s, experiment_id, fmt, batch_size=100, spool_in_memory=1 << 16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    with body:
        if fmt == "parquet":
            return peak, pq.ParquetFile(body).metadata.num_rows
        return peak, len(body.read().splitlines()) - 1


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_an_export_of_20x_the_runs_takes_about_the_same_memory(
    session_factory: sessionmaker[Session], fmt: str
) -> None:
    """Batches of 100 runs, 64 KiB of temporary file in memory: 200 runs vs 4,000."""
    tag = datetime.now(UTC).strftime("%H%M%S%f")
    few = _seed_one(session_factory, 200, f"mem-few-{fmt}-{tag}")
    many = _seed_one(session_factory, 4000, f"mem-many-{fmt}-{tag}")
    _peak(session_factory, few, fmt)  # warm: imports, compiled statements
    few_peak, few_runs = _peak(session_factory, few, fmt)
    many_peak, many_runs = _peak(session_factory, many, fmt)
    assert (few_runs, many_runs) == (200, 4000)
    # what grows is Parquet's footer: a few hundred bytes per row group and column
    assert many_peak < 1.5 * few_peak, (few_peak, many_peak)
