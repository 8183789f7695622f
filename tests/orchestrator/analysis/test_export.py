"""orchestrator.analysis.export: the runs table and its CSV / Parquet bytes."""

from __future__ import annotations

import io
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd

from orchestrator.analysis.export import parquet_safe, runs_table, to_csv_bytes, to_parquet_bytes


def run_rows() -> list[dict[str, Any]]:
    t0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    common = {
        "experiment_id": "e1",
        "model_id": "small",
        "model_digest": "sha256:abc",
        "max_model_len": 2048,
        "request_list_hash": "h1",
        "vllm_version": "0.32.0",
        "finished_at": None,
    }
    return [
        {
            **common,
            "id": "r1",
            "variant": "baseline",
            "repeat_index": 0,
            "sequence": 0,
            "status": "succeeded",
            "started_at": t0,
            "layout": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1},
            "workload": {"kind": "shared_prefix", "num_requests": 16, "extra": {"a": 1}},
            "engine_args": {"enable_prefix_caching": False, "max_num_seqs": None},
            "metrics": {"median_ttft_ms": 12.5, "output_throughput": 100.0},
        },
        {
            **common,
            "id": "r2",
            "variant": "apc-on",
            "repeat_index": 0,
            "sequence": 1,
            "status": "failed",
            "started_at": t0,
            "layout": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1},
            "workload": {"kind": "shared_prefix", "num_requests": 16, "extra": {"a": 2}},
            "engine_args": {"enable_prefix_caching": "auto", "max_num_seqs": 8, "tags": [1, 2]},
            "metrics": {},
        },
        {
            **common,
            "id": "r3",
            "variant": "apc-on",
            "repeat_index": 1,
            "sequence": 2,
            "status": "succeeded",
            "started_at": t0,
            "layout": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1},
            "workload": {"kind": "shared_prefix", "num_requests": 16},
            "engine_args": {"enable_prefix_caching": None, "max_num_seqs": 8.5},
            "metrics": {"median_ttft_ms": 7.5},
        },
    ]


def test_runs_table_columns() -> None:
    df = runs_table(run_rows())
    cols = list(df.columns)
    assert cols[:4] == ["id", "experiment_id", "variant", "repeat_index"]
    for c in (
        "layout.tensor_parallel_size",
        "workload.extra.a",
        "engine_args.enable_prefix_caching",
        "engine_args.tags",
        "metrics.median_ttft_ms",
    ):
        assert c in cols
    assert cols.index("layout.tensor_parallel_size") < cols.index("workload.kind")
    assert cols.index("engine_args.max_num_seqs") < cols.index("metrics.median_ttft_ms")
    assert df["layout.tensor_parallel_size"].tolist() == [1, 2, 2]
    assert df.loc[1, "engine_args.tags"] == "[1, 2]"
    assert pd.isna(df.loc[1, "metrics.median_ttft_ms"])
    assert runs_table([]).empty


def test_csv_round_trip() -> None:
    df = runs_table(run_rows())
    back = pd.read_csv(io.BytesIO(to_csv_bytes(df)))
    assert list(back.columns) == list(df.columns)
    assert back["id"].tolist() == ["r1", "r2", "r3"]
    assert back["layout.tensor_parallel_size"].tolist() == [1, 2, 2]
    np.testing.assert_allclose(back["metrics.median_ttft_ms"], [12.5, np.nan, 7.5])
    assert back["engine_args.enable_prefix_caching"].tolist()[:2] == ["False", "auto"]


def test_parquet_round_trip_with_mixed_types() -> None:
    df = runs_table(run_rows())
    back = pd.read_parquet(io.BytesIO(to_parquet_bytes(df)), engine="pyarrow")
    assert list(back.columns) == list(df.columns)
    safe = parquet_safe(df)
    assert safe["engine_args.enable_prefix_caching"].tolist() == ["false", "auto", None]
    apc = back["engine_args.enable_prefix_caching"].tolist()
    assert apc[:2] == ["false", "auto"] and pd.isna(apc[2])
    assert back["engine_args.max_num_seqs"].tolist()[1:] == [8.0, 8.5]
    assert back["layout.tensor_parallel_size"].tolist() == [1, 2, 2]
    np.testing.assert_allclose(back["metrics.median_ttft_ms"], [12.5, np.nan, 7.5])
    assert back["started_at"].tolist() == df["started_at"].tolist()
    pd.testing.assert_frame_equal(
        back.astype(str), safe.astype(str), check_dtype=False, check_column_type=False
    )
