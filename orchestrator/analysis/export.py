"""Export: an experiment's runs as one flat table (config and metrics in dotted columns),
as CSV or Parquet bytes.

Pure functions: no database, no Ray, no FastAPI.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from datetime import date, datetime
from typing import Any

import numpy as np
import pandas as pd

#: Leading columns of :func:`runs_table`, in order (when present).
RUN_COLUMNS = (
    "id",
    "experiment_id",
    "variant",
    "repeat_index",
    "sequence",
    "status",
    "started_at",
    "finished_at",
    "model_id",
    "model_digest",
    "max_model_len",
    "request_list_hash",
    "vllm_version",
)
#: Nested groups flattened into ``group.key`` columns, in this order.
NESTED_GROUPS = ("layout", "workload", "engine_args", "metrics")


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, list | tuple):
        out[prefix] = json.dumps(list(value), default=str)
    else:
        out[prefix] = value


def runs_table(runs: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per run, nested dicts flattened into dotted columns.

    Args:
        runs: run rows: ``id``, ``experiment_id``, ``variant``,
            ``repeat_index``, ``sequence``, ``status``, ``started_at``,
            ``finished_at``, ``model_id``, ``model_digest``, ``max_model_len``,
            ``request_list_hash``, ``vllm_version`` and the dicts ``layout``,
            ``workload``, ``engine_args`` (explicit ones), ``metrics``.

    Returns:
        A DataFrame: :data:`RUN_COLUMNS` first, then other top-level keys,
        then ``layout.*``, ``workload.*``, ``engine_args.*``, ``metrics.*``
        (each sorted by name), then any other nested group. Nested dicts
        become ``a.b.c`` columns; lists become JSON strings; absent values
        are None/NaN. Values keep their types (see :func:`to_parquet_bytes`).
    """
    rows: list[dict[str, Any]] = []
    for run in runs:
        flat: dict[str, Any] = {}
        _flatten("", run, flat)
        rows.append(flat)
    seen: dict[str, None] = {}
    for row in rows:
        seen.update(dict.fromkeys(row))
    head = [c for c in RUN_COLUMNS if c in seen]
    top = [c for c in seen if "." not in c and c not in head]
    groups: list[str] = []
    for g in NESTED_GROUPS:
        groups += sorted(c for c in seen if c.startswith(g + "."))
    rest = sorted(c for c in seen if "." in c and c not in groups)
    columns = head + top + groups + rest
    return pd.DataFrame.from_records(rows, columns=columns)


def _kind(v: Any) -> str:
    if isinstance(v, bool | np.bool_):
        return "bool"
    if isinstance(v, int | np.integer | float | np.floating):
        return "number"
    if isinstance(v, str):
        return "str"
    if isinstance(v, datetime | date | pd.Timestamp):
        return "datetime"
    return "other"


def _is_missing(v: Any) -> bool:
    if v is None:
        return True
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def _to_text(v: Any) -> str | None:
    if _is_missing(v):
        return None
    if isinstance(v, str):
        return v
    if isinstance(v, np.generic):
        v = v.item()
    return json.dumps(v, default=str)


def parquet_safe(df: pd.DataFrame) -> pd.DataFrame:
    """A copy whose object columns pyarrow can store.

    Per object column (missing values stay missing): only numbers -> float;
    one kind only (bool, str, datetime) -> unchanged; mixed kinds or other
    objects -> text (strings as is, others as JSON, e.g. ``true``, ``2048``).
    """
    out = df.copy()
    for col in out.columns:
        if out[col].dtype != object:
            continue
        kinds = {_kind(v) for v in out[col] if not _is_missing(v)}
        if kinds == {"number"}:
            out[col] = pd.to_numeric(out[col], errors="coerce").astype("float64")
        elif len(kinds) > 1 or "other" in kinds:
            out[col] = pd.Series([_to_text(v) for v in out[col]], index=out.index, dtype=object)
    return out


def to_csv_bytes(df: pd.DataFrame) -> bytes:
    """UTF-8 CSV with a header row and no index."""
    return df.to_csv(index=False).encode("utf-8")


def to_parquet_bytes(df: pd.DataFrame) -> bytes:
    """Parquet (pyarrow engine, no index) of :func:`parquet_safe` ``(df)``."""
    buf = io.BytesIO()
    parquet_safe(df).to_parquet(buf, engine="pyarrow", index=False)
    return buf.getvalue()
