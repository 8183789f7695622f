"""orchestrator.analysis.export.write_export: the export built batch by batch gives the
bytes of the whole table's (:func:`runs_table` then :func:`to_csv_bytes` /
:func:`to_parquet_bytes`), whatever the batches see of the columns' types."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow.parquet as pq
import pytest

from orchestrator.analysis.export import runs_table, to_csv_bytes, to_parquet_bytes, write_export
from tests.orchestrator.analysis.test_export import run_rows


def tricky_rows() -> list[dict[str, Any]]:
    """Rows whose columns a part of them would type otherwise than the whole does:
    an int column with a value missing only late (float), a bool column missing only
    late (object), a column of ints then strings (object, text in Parquet), a datetime
    with sub-second precision only in the last row, a column present only in the
    middle, a metric of one run, a timestamp missing in the first rows only, a
    column that is always missing, a list."""
    t0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    rows: list[dict[str, Any]] = []
    for i in range(7):
        rows.append(
            {
                "id": f"r{i}",
                "experiment_id": "e1",
                "variant": "baseline" if i == 0 else f"v{i}",
                "repeat_index": i % 2,
                "sequence": i,
                "status": "succeeded",
                "started_at": t0 + timedelta(minutes=i),
                "finished_at": None if i < 3 else t0 + timedelta(minutes=i, seconds=30),
                "model_id": "small",
                "model_digest": "sha256:abc",
                "max_model_len": 2048 if i < 6 else None,
                "request_list_hash": "h1",
                "vllm_version": None,
                "layout": {"tensor_parallel_size": 1, "devices": [0, i]},
                "workload": {"num_requests": 16} if i != 3 else {"num_requests": 16, "x": "y"},
                "engine_args": {
                    "enable_prefix_caching": i % 2 == 0 if i < 5 else None,
                    "max_num_seqs": 8 if i < 4 else "auto",
                },
                "metrics": {"median_ttft_ms": 10.0 + i, **({"p99_ttft_ms": 3.0} if i == 2 else {})},
            }
        )
    rows[-1]["started_at"] += timedelta(microseconds=250)
    return rows


def _write(rows: list[dict[str, Any]], fmt: str, batch: int, spool: int = 1 << 20) -> bytes:
    out = io.BytesIO()
    parts = [rows[i : i + batch] for i in range(0, len(rows), batch)]
    write_export(parts, fmt, out, spool_in_memory=spool)
    return out.getvalue()


@pytest.mark.parametrize("rows", [tricky_rows(), run_rows()], ids=["tricky", "plain"])
@pytest.mark.parametrize("batch", [1, 2, 3, 100])
def test_streamed_csv_is_the_whole_tables_bytes(rows: list[dict[str, Any]], batch: int) -> None:
    whole = to_csv_bytes(runs_table(rows))
    assert _write(rows, "csv", batch) == whole
    assert _write(rows, "csv", batch, spool=64) == whole  # the spool on disk


@pytest.mark.parametrize("rows", [tricky_rows(), run_rows()], ids=["tricky", "plain"])
@pytest.mark.parametrize("batch", [1, 2, 3, 100])
def test_streamed_parquet_is_the_whole_tables(rows: list[dict[str, Any]], batch: int) -> None:
    whole = to_parquet_bytes(runs_table(rows))
    streamed = _write(rows, "parquet", batch)
    if batch >= len(rows):  # one row group: the very bytes
        assert streamed == whole
    got, want = pq.ParquetFile(io.BytesIO(streamed)), pq.ParquetFile(io.BytesIO(whole))
    assert got.metadata.num_row_groups == -(-len(rows) // batch)
    assert got.schema_arrow.equals(want.schema_arrow, check_metadata=True)
    assert got.read().equals(want.read())


def test_no_runs_is_the_empty_tables_bytes() -> None:
    assert _write([], "csv", 10) == to_csv_bytes(runs_table([]))
    assert _write([], "parquet", 10) == to_parquet_bytes(runs_table([]))
