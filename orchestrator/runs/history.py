"""Run history: the filtered, sorted, server-paginated run list behind the dashboard's
first page and ``GET /api/v1/history``.

One query per page: runs joined to their experiment (for its name) and, when
the sort key is a metric, to that one ``run_metrics`` row; the page's summary
metrics are then read for its runs only. Indexes that keep it fast with tens of
thousands of runs (migration 0007): ``runs(created_at)``, ``run_metrics(name,
value)``, and a GIN index on ``runs.engine_args`` for the ``@>`` containment
filter. Figures: ``docs/BENCHMARKS.md`` ("Run history").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, func, select, text, type_coerce
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session, aliased

from orchestrator.core.models import Experiment, Run, RunMetric
from orchestrator.core.repositories import RunRepository

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


_NOT_NULL = frozenset({"submitted", "sequence", "model", "status", "experiment"})


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

    def conditions(self) -> list[ColumnElement[bool]]:
        conds: list[ColumnElement[bool]] = []
        if self.experiment_id:
            conds.append(Run.experiment_id == self.experiment_id)
        if self.model:
            conds.append(Run.model_id == self.model)
        if self.status:
            conds.append(Run.status == self.status)
        if self.experiment:
            needle = self.experiment.replace("\\", "\\\\").replace("%", r"\%").replace("_", r"\_")
            # a subquery over the (much smaller) experiments table, then the runs by
            # ix_runs_experiment_position, instead of filtering every joined run
            matching = select(Experiment.id).where(
                (Experiment.id == self.experiment)
                | Experiment.name.ilike(f"%{needle}%", escape="\\")
            )
            conds.append(Run.experiment_id.in_(matching))
        if self.engine_arg:
            name, value = self.engine_arg
            conds.append(type_coerce(Run.engine_args, JSONB).contains({name: value}))
        if self.since:
            conds.append(Run.created_at >= self.since)
        if self.until:
            conds.append(Run.created_at < self.until)
        return conds


@dataclass
class HistoryRow:
    """One row of the history table: ``run_metrics`` holds all the run's summary metrics
    (stored names), ``metrics`` the :data:`METRIC_COLUMNS` ones by column key."""

    run: Run
    experiment_name: str
    run_metrics: dict[str, float] = field(default_factory=dict)

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
    total: int
    limit: int
    offset: int


def _order(stmt: Any, sort: str, descending: bool) -> Any:
    if sort not in SORT_KEYS:
        raise HistoryQueryError("sort", f"sort must be one of {', '.join(SORT_KEYS)}; got {sort!r}")
    key: Any
    if sort in METRIC_COLUMNS:
        metric = aliased(RunMetric)
        stmt = stmt.outerjoin(
            metric, (metric.run_id == Run.id) & (metric.name == METRIC_COLUMNS[sort])
        )
        key = metric.value
    else:
        key = {
            "submitted": Run.created_at,
            "sequence": Run.sequence,
            "started": Run.started_at,
            "duration": Run.finished_at - Run.started_at,
            "experiment": Experiment.name,
            "model": Run.model_id,
            "status": Run.status,
            "variable": Run.variable,
        }[sort]
    if sort in _NOT_NULL:
        # plain ASC/DESC so the b-tree index (e.g. ix_runs_created) gives the order
        ordered = key.desc() if descending else key.asc()
    else:
        ordered = key.desc().nulls_last() if descending else key.asc().nulls_last()
    tie = Run.id.desc() if descending else Run.id.asc()
    return stmt.order_by(ordered, tie)


def history_page(
    session: Session,
    flt: HistoryFilter,
    *,
    sort: str = "submitted",
    descending: bool = True,
    limit: int = 50,
    offset: int = 0,
) -> HistoryPage:
    """One page of the run history, newest first by default; rows without the sort value
    (e.g. no metric yet) come last in either direction.

    Raises:
        HistoryQueryError: unknown sort key.
    """
    conds = flt.conditions()
    base = select(Run, Experiment.name).join(Experiment, Experiment.id == Run.experiment_id)
    total = session.scalar(select(func.count()).select_from(Run).where(*conds)) or 0
    stmt = _order(base.where(*conds), sort, descending).limit(limit).offset(offset)
    found: Sequence[Any] = session.execute(stmt).all()
    metrics = RunRepository(session).metrics_for([r.id for r, _ in found])
    rows = []
    for run, name in found:
        rows.append(HistoryRow(run=run, experiment_name=name, run_metrics=metrics.get(run.id, {})))
    return HistoryPage(rows=rows, total=total, limit=limit, offset=offset)


def distinct_models(session: Session, limit: int = 200) -> list[str]:
    """Model ids present in the run history (for the model filter), alphabetical.

    A recursive skip scan over ``ix_runs_model_created``: one index probe per
    distinct model instead of reading every run.
    """
    rows = session.execute(
        text(
            """
            WITH RECURSIVE m(model_id) AS (
                (SELECT model_id FROM runs ORDER BY model_id LIMIT 1)
                UNION ALL
                SELECT (SELECT r.model_id FROM runs r WHERE r.model_id > m.model_id
                        ORDER BY r.model_id LIMIT 1)
                FROM m WHERE m.model_id IS NOT NULL
            )
            SELECT model_id FROM m WHERE model_id IS NOT NULL LIMIT :limit
            """
        ),
        {"limit": limit},
    )
    return [r[0] for r in rows]
