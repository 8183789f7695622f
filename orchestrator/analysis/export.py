"""Export: an experiment's runs as one flat table (config and metrics in dotted columns),
as CSV or Parquet: whole (:func:`runs_table`, :func:`to_csv_bytes`,
:func:`to_parquet_bytes`) or streamed in constant memory (:func:`write_export`: the
same bytes, built batch by batch).

Pure functions: no database, no Ray, no FastAPI.
"""

from __future__ import annotations

import io
import json
import pickle
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from datetime import date, datetime
from typing import IO, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

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


def _columns(seen: Iterable[str]) -> list[str]:
    """The table's columns, in order, of the (flattened) keys ``seen`` in its rows."""
    seen = list(seen)
    head = [c for c in RUN_COLUMNS if c in seen]
    top = [c for c in seen if "." not in c and c not in head]
    groups: list[str] = []
    for g in NESTED_GROUPS:
        groups += sorted(c for c in seen if c.startswith(g + "."))
    rest = sorted(c for c in seen if "." in c and c not in groups)
    return head + top + groups + rest


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
    return pd.DataFrame.from_records(rows, columns=_columns(seen))


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


def parquet_safe(df: pd.DataFrame, kinds_of: Mapping[str, set[str]] | None = None) -> pd.DataFrame:
    """A copy whose object columns pyarrow can store.

    Per object column (missing values stay missing): only numbers -> float;
    one kind only (bool, str, datetime) -> unchanged; mixed kinds or other
    objects -> text (strings as is, others as JSON, e.g. ``true``, ``2048``).
    ``kinds_of``: the kinds of each column's values in the whole table, when ``df`` is
    a part of it (else those of ``df``'s values).
    """
    out = df.copy()
    for col in out.columns:
        if out[col].dtype != object:
            continue
        if kinds_of is not None:
            kinds = kinds_of.get(col, set())
        else:
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


#: Runs per batch of a streamed export: read from the database, and per Parquet row group.
EXPORT_BATCH = 500
#: Bytes a streamed export's temporary files hold in memory before they go to disk.
SPOOL_IN_MEMORY = 2 * 1024 * 1024

#: How precisely pandas writes a datetime column to CSV: the finest any of its values
#: needs (dates only, seconds, milliseconds, microseconds), for every value of it.
_TIMESPEC = {1: "seconds", 2: "milliseconds", 3: "microseconds"}


def _time_rank(v: datetime) -> int:
    if v.microsecond % 1000:
        return 3
    if v.microsecond:
        return 2
    if v.tzinfo is None and v.hour == v.minute == v.second == 0:
        return 0  # a date (a column of such naive values is written as dates)
    return 1


def flat_run(run: Mapping[str, Any]) -> dict[str, Any]:
    """A run row (see :func:`runs_table`) with its nested dicts flattened (``a.b``)."""
    flat: dict[str, Any] = {}
    _flatten("", run, flat)
    return flat


class TableShape:
    """What :func:`runs_table` would make of all the rows, learnt a batch at a time: the
    columns and, per column, the dtype pandas gives it, the kinds of its values (for
    :func:`parquet_safe`) and how precisely its datetimes are written. Its size grows
    with the number of columns, not of rows. A part of the rows then becomes exactly
    its rows of the whole table (:meth:`frame`)."""

    def __init__(self) -> None:
        self.rows = 0
        self.seen: dict[str, None] = {}
        self.present: dict[str, int] = {}  # rows that have the column (missing or not)
        self.samples: dict[str, dict[Any, Any]] = {}  # one value per type of value
        self.kinds: dict[str, set[str]] = {}
        self.times: dict[str, int] = {}
        self._dtypes: dict[str, Any] | None = None

    def add(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Learn from ``rows`` (flattened, :func:`flat_run`)."""
        self._dtypes = None
        self.rows += len(rows)
        for row in rows:
            self.seen.update(dict.fromkeys(row))
            for col, v in row.items():
                self.present[col] = self.present.get(col, 0) + 1
                samples = self.samples.setdefault(col, {})
                kinds = self.kinds.setdefault(col, set())
                if _is_missing(v):
                    samples.setdefault(("missing", type(v)), v)
                    continue
                kinds.add(_kind(v))
                if type(v) is int:  # the extremes decide int64, uint64 or object
                    low, high = samples.get("min", v), samples.get("max", v)
                    samples["min"], samples["max"] = min(low, v), max(high, v)
                elif isinstance(v, datetime):
                    samples.setdefault((datetime, str(v.tzinfo)), v)
                    self.times[col] = max(self.times.get(col, 0), _time_rank(v))
                else:
                    samples.setdefault(type(v), v)

    @property
    def columns(self) -> list[str]:
        return _columns(self.seen)

    def _samples(self) -> dict[str, list[Any]]:
        """Per column, a value of each type it holds (NaN where a row lacks it), all
        columns as long (a list repeats its first value): a table pandas types as the
        whole one."""
        columns = {c: list(self.samples[c].values()) for c in self.columns}
        for c, values in columns.items():
            if self.present[c] < self.rows:
                values.append(np.nan)
        length = max((len(v) for v in columns.values()), default=0)
        return {c: v + v[:1] * (length - len(v)) for c, v in columns.items()}

    @property
    def dtypes(self) -> dict[str, Any]:
        """Each column's dtype in the whole table (as :func:`runs_table` infers it)."""
        if self._dtypes is None:
            samples = self._samples()
            length = len(next(iter(samples.values()), []))
            recs = [{c: v[i] for c, v in samples.items()} for i in range(length)]
            rep = pd.DataFrame.from_records(recs, columns=self.columns)
            self._dtypes = dict(rep.dtypes.items())
        return self._dtypes

    def frame(self, rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
        """``rows`` (flattened, a part of those learnt) as their rows of the whole
        table: its columns, its dtypes (a column whose values in ``rows`` alone would
        infer another is built from them with the whole's)."""
        df = pd.DataFrame.from_records(list(rows), columns=list(self.dtypes))
        for col, dtype in self.dtypes.items():
            if df[col].dtype != dtype:
                values = [row.get(col, np.nan) for row in rows]
                df[col] = pd.Series(values, index=df.index, dtype=dtype)
        return df

    def csv_frame(self, df: pd.DataFrame) -> pd.DataFrame:
        """``df`` (of :meth:`frame`) with each datetime column written as precisely as
        in the whole table: pandas picks the precision a column's values need, so a
        part whose values need less is written here, value by value."""
        for col, rank in self.times.items():
            dtype = self.dtypes[col]
            if not (isinstance(dtype, pd.DatetimeTZDtype) or dtype.kind == "M"):
                continue
            need = max((_time_rank(v) for v in df[col] if not pd.isna(v)), default=-1)
            if need < rank and rank > 0:
                df[col] = pd.Series(
                    [None if pd.isna(v) else v.isoformat(" ", _TIMESPEC[rank]) for v in df[col]],
                    index=df.index,
                    dtype=object,
                )
        return df

    def arrow_schema(self) -> pa.Schema:
        """The Parquet schema of the whole table (after :func:`parquet_safe`)."""
        rep = pd.DataFrame(
            {c: pd.Series(v, dtype=self.dtypes[c]) for c, v in self._samples().items()}
        )
        return pa.Schema.from_pandas(parquet_safe(rep, self.kinds), preserve_index=False)


def write_export(
    batches: Iterable[Sequence[Mapping[str, Any]]],
    fmt: str,
    out: IO[bytes],
    *,
    spool_in_memory: int = SPOOL_IN_MEMORY,
) -> None:
    """Write the runs of ``batches`` (run rows, see :func:`runs_table`) to ``out`` as CSV
    or Parquet (``fmt``): the bytes of ``to_csv_bytes(runs_table(runs))`` or
    ``to_parquet_bytes(runs_table(runs))`` (Parquet: one row group per batch), in memory
    that does not grow with the number of runs.

    Two passes: the first flattens each batch, learns the whole table's columns and
    types (:class:`TableShape`) and keeps the flattened rows in a temporary file (in
    memory up to ``spool_in_memory`` bytes, then on disk); the second writes each batch
    as its rows of the whole table.
    """
    shape = TableShape()
    with tempfile.SpooledTemporaryFile(max_size=spool_in_memory) as spool:
        parts = 0
        for batch in batches:
            flat = [flat_run(run) for run in batch]
            if not flat:
                continue
            shape.add(flat)
            pickle.dump(flat, spool, protocol=pickle.HIGHEST_PROTOCOL)
            parts += 1
        if not parts:  # no runs: no columns either
            empty = runs_table([])
            out.write(to_parquet_bytes(empty) if fmt == "parquet" else to_csv_bytes(empty))
            return
        spool.seek(0)
        if parts == 1:  # the whole table at once (the rows of one batch)
            df = pd.DataFrame.from_records(pickle.load(spool), columns=shape.columns)
            out.write(to_parquet_bytes(df) if fmt == "parquet" else to_csv_bytes(df))
            return
        frames = (shape.frame(pickle.load(spool)) for _ in range(parts))
        if fmt == "parquet":
            schema = shape.arrow_schema()
            writer: pq.ParquetWriter | None = None
            try:
                for df in frames:
                    table = pa.Table.from_pandas(
                        parquet_safe(df, shape.kinds), schema=schema, preserve_index=False
                    )
                    if writer is None:  # as pandas' to_parquet writes it
                        writer = pq.ParquetWriter(out, table.schema, compression="snappy")
                    writer.write_table(table)
            finally:
                if writer is not None:
                    writer.close()
        else:
            for i, df in enumerate(frames):
                text = shape.csv_frame(df).to_csv(index=False, header=i == 0)
                out.write(text.encode("utf-8"))
