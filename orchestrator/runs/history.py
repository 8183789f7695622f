"""Run history: the filtered, sorted, server-paginated run list behind the dashboard's
first page and ``GET /api/v1/history``.

The query (runs joined to their experiment, walking the index of the sort; a metric
sorts by its copy on the run, ``runs.sort_*``) is
:class:`orchestrator.core.repositories.HistoryRepository`'s; the page's summary
metrics are then read for its runs only. Deep pages go by an opaque keyset cursor
(:func:`encode_cursor`), large counts are estimated. Figures: ``docs/BENCHMARKS.md`` ("Run
history").
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from orchestrator.core.models import RUN_SORT_METRICS, Run
from orchestrator.core.repositories import HistoryRepository, RunRepository

#: Columns of the history table that come from ``run_metrics`` (vLLM bench serve names).
METRIC_COLUMNS: dict[str, str] = {
    "ttft_p50": "median_ttft_ms",
    "ttft_p99": "p99_ttft_ms",
    "e2el_p50": "median_e2el_ms",
    "output_throughput": "output_throughput",
    "hit_rate": "prefix_cache_hit_rate",
}

#: Sort keys: the table's columns. ``duration`` is ``finished_at - started_at``;
#: ``sequence`` is the execution order within an experiment.
SORT_KEYS: tuple[str, ...] = (
    "submitted",
    "sequence",
    "started",
    "duration",
    "experiment",
    "model",
    "status",
    "variable",
    *METRIC_COLUMNS,
)


class HistoryQueryError(ValueError):
    """A filter or sort parameter that cannot be applied; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def parse_engine_arg(text: str) -> tuple[str, Any]:
    """``"enable_prefix_caching=true"`` -> ``("enable_prefix_caching", True)``.

    The name may use dashes (``--max-num-seqs=64`` works too); the value is read
    as JSON (``true``, ``64``, ``0.9``, ``null``) and otherwise kept as text.

    Raises:
        HistoryQueryError: no ``=`` or an empty name.
    """
    name, sep, raw = text.strip().partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    if not sep or not name:
        raise HistoryQueryError("engine_arg", f"engine_arg must look like name=value, got {text!r}")
    raw = raw.strip()
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return name, value


@dataclass(frozen=True)
class HistoryFilter:
    """Filters of the run history; ``None`` means no filter.

    ``experiment_id`` matches one experiment exactly.
    ``experiment`` matches the experiment's id exactly or its name as a
    case-insensitive substring. ``since``/``until`` bound the submission time
    (``runs.created_at``), ``until`` exclusive.
    """

    experiment_id: str | None = None
    model: str | None = None
    status: str | None = None
    experiment: str | None = None
    engine_arg: tuple[str, Any] | None = None
    since: datetime | None = None
    until: datetime | None = None


@dataclass
class HistoryRow:
    """One row of the history table: ``run_metrics`` holds all the run's summary metrics
    (stored names), ``metrics`` the :data:`METRIC_COLUMNS` ones by column key."""

    run: Run
    experiment_name: str
    run_metrics: dict[str, float] = field(default_factory=dict)
    #: the run's ``enable_prefix_caching`` engine argument (None when unset)
    prefix_caching: Any = None

    @property
    def metrics(self) -> dict[str, float]:
        m = self.run_metrics
        return {k: m[v] for k, v in METRIC_COLUMNS.items() if v in m}

    @property
    def duration_s(self) -> float | None:
        if self.run.started_at and self.run.finished_at:
            return (self.run.finished_at - self.run.started_at).total_seconds()
        return None

    @property
    def change(self) -> str:
        """``"enable_prefix_caching = true"``, ``"(baseline)"``, or the changes joined."""
        if self.run.is_baseline:
            return "(baseline)"
        parts = [
            f"{k.rpartition('.')[2]} = {json.dumps(v)}" for k, v in sorted(self.run.changes.items())
        ]
        return ", ".join(parts) or (self.run.variable or "")


@dataclass
class HistoryPage:
    rows: list[HistoryRow]
    #: how many runs match; ``estimated``: an estimate (above
    #: ``HistoryRepository.EXACT_COUNT_UP_TO``), to show as "about N"
    total: int
    limit: int
    offset: int
    estimated: bool = False
    #: the opaque cursor of the next page (``after``), None on the last page
    next_cursor: str | None = None


def _tag(value: Any) -> Any:
    if isinstance(value, datetime):
        return {"t": value.isoformat()}
    if isinstance(value, timedelta):
        return {"s": value.total_seconds()}
    return value


def _untag(value: Any) -> Any:
    if isinstance(value, dict):
        if "t" in value:
            return datetime.fromisoformat(value["t"])
        return timedelta(seconds=value["s"])
    return value


def encode_cursor(sort: str, descending: bool, key: list[Any]) -> str:
    """The opaque cursor of the page after the row whose sort values are ``key``
    (URL-safe base64 of JSON: the sort, its direction and the values)."""
    raw = json.dumps([sort, descending, [_tag(v) for v in key]], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str, sort: str, descending: bool) -> list[Any]:
    """The sort values in ``cursor`` (from :func:`encode_cursor`).

    Raises:
        HistoryQueryError: not a cursor of this sort and direction.
    """
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        c_sort, c_desc, values = json.loads(raw)
        key = [_untag(v) for v in values]
    except (ValueError, TypeError, KeyError, binascii.Error):
        raise HistoryQueryError("cursor", "cursor is not one this service gave") from None
    if c_sort != sort or c_desc != descending:
        raise HistoryQueryError(
            "cursor", f"cursor belongs to sort={c_sort} ({'desc' if c_desc else 'asc'})"
        )
    return key


def history_page(
    session: Session,
    flt: HistoryFilter,
    *,
    sort: str = "submitted",
    descending: bool = True,
    limit: int = 50,
    offset: int = 0,
    cursor: str | None = None,
    brief: bool = False,
) -> HistoryPage:
    """One page of the run history, the newest experiment first by default (its runs
    together, in start order); rows without the sort value (e.g. no metric yet) come
    last in either direction.

    ``cursor`` (a previous page's ``next_cursor``): the page right after that page's
    last row, ``offset`` rows further on; as cheap at page 10,000 as at page 1.
    ``brief`` (the dashboard's table): each run carries only what a row of the table
    shows (:data:`orchestrator.core.repositories.HistoryRepository.TABLE_COLUMNS`) and
    ``run_metrics`` only the :data:`METRIC_COLUMNS` metrics: a page of real runs reads
    ~50 kB from the database instead of ~1.2 MB.

    Raises:
        HistoryQueryError: unknown sort key, or a cursor of another sort.
    """
    if sort not in SORT_KEYS:
        raise HistoryQueryError("sort", f"sort must be one of {', '.join(SORT_KEYS)}; got {sort!r}")
    after = decode_cursor(cursor, sort, descending) if cursor else None
    metric = METRIC_COLUMNS.get(sort)
    found = HistoryRepository(session).page(
        {f.name: getattr(flt, f.name) for f in fields(flt)},
        sort=RUN_SORT_METRICS[metric] if metric else sort,
        descending=descending,
        limit=limit,
        offset=offset,
        after=after,
        brief=brief,
    )
    metrics = RunRepository(session).metrics_for(
        [r.id for r, _, _ in found.rows], METRIC_COLUMNS.values() if brief else None
    )
    rows = [
        HistoryRow(
            run=run, experiment_name=name, run_metrics=metrics.get(run.id, {}), prefix_caching=apc
        )
        for run, name, apc in found.rows
    ]
    return HistoryPage(
        rows=rows,
        total=found.total,
        limit=limit,
        offset=offset,
        estimated=found.estimated,
        next_cursor=encode_cursor(sort, descending, found.next_key) if found.next_key else None,
    )


def distinct_models(session: Session, limit: int = 200) -> list[str]:
    """Model ids present in the run history (for the model filter), alphabetical.

    A recursive skip scan over ``ix_runs_model_created``: one index probe per
    distinct model instead of reading every run.
    """
    return HistoryRepository(session).distinct_models(limit)
