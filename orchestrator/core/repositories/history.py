"""The run history: filtered, sorted pages of runs (:mod:`orchestrator.runs.history`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, func, select, text, type_coerce
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session, aliased, load_only

from orchestrator.core.models import Experiment, Run, RunMetric


class HistoryRepository:
    """The run history (:mod:`orchestrator.runs.history`): filtered, sorted pages of runs.

    One query per page: runs joined to their experiment (for its name) and, when the
    sort key is a metric, to that one ``run_metrics`` row. Indexes that keep it fast
    (migration 0007): ``runs(created_at)``, ``run_metrics(name, value)``, and a GIN
    index on ``runs.engine_args`` for the ``@>`` containment filter.
    """

    #: sort keys of columns that are never NULL (plain ASC/DESC: the b-tree index orders)
    NOT_NULL = frozenset({"submitted", "sequence", "model", "status", "experiment"})

    #: What a row of the history table shows (``brief`` pages load only these): a real
    #: run's configuration and engine details are ~25 kB of JSON, a 50-run page ~1.2 MB.
    TABLE_COLUMNS = (
        Run.id,
        Run.experiment_id,
        Run.name,
        Run.is_baseline,
        Run.repeat_index,
        Run.sequence,
        Run.variable,
        Run.changes,
        Run.model_id,
        Run.status,
        Run.partial,
        Run.created_at,
        Run.started_at,
        Run.finished_at,
    )

    def __init__(self, session: Session) -> None:
        self.session = session

    @staticmethod
    def _conditions(
        *,
        experiment_id: str | None = None,
        model: str | None = None,
        status: str | None = None,
        experiment: str | None = None,
        engine_arg: tuple[str, Any] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> list[ColumnElement[bool]]:
        conds: list[ColumnElement[bool]] = []
        if experiment_id:
            conds.append(Run.experiment_id == experiment_id)
        if model:
            conds.append(Run.model_id == model)
        if status:
            conds.append(Run.status == status)
        if experiment:
            needle = experiment.replace("\\", "\\\\").replace("%", r"\%").replace("_", r"\_")
            # a subquery over the (much smaller) experiments table, then the runs by
            # ix_runs_experiment_position, instead of filtering every joined run
            matching = select(Experiment.id).where(
                (Experiment.id == experiment) | Experiment.name.ilike(f"%{needle}%", escape="\\")
            )
            conds.append(Run.experiment_id.in_(matching))
        if engine_arg:
            name, value = engine_arg
            conds.append(type_coerce(Run.engine_args, JSONB).contains({name: value}))
        if since:
            conds.append(Run.created_at >= since)
        if until:
            conds.append(Run.created_at < until)
        return conds

    def page(
        self,
        filters: dict[str, Any],
        *,
        sort: str,
        metric: str | None,
        descending: bool,
        limit: int,
        offset: int,
        brief: bool = False,
    ) -> tuple[list[tuple[Run, str, Any]], int]:
        """``(run, experiment name, enable_prefix_caching)`` rows of one page and the total
        matching ``filters``; the third is the run's engine argument (None when unset).

        ``filters``: the fields of ``orchestrator.runs.history.HistoryFilter``. ``sort``: a
        column key (``submitted``, ``sequence``, ``started``, ``duration``, ``experiment``,
        ``model``, ``status``, ``variable``) or, with ``metric`` (a ``run_metrics`` name),
        any key; rows without the sort value come last in either direction. ``brief``: the
        runs carry only :data:`TABLE_COLUMNS` (reading another attribute raises).
        """
        conds = self._conditions(**filters)
        prefix_caching = type_coerce(Run.engine_args, JSONB)["enable_prefix_caching"]
        stmt: Any = (
            select(Run, Experiment.name, prefix_caching)
            .join(Experiment, Experiment.id == Run.experiment_id)
            .where(*conds)
        )
        if brief:
            stmt = stmt.options(load_only(*self.TABLE_COLUMNS, raiseload=True))
        key: Any
        if metric is not None:
            row = aliased(RunMetric)
            stmt = stmt.outerjoin(row, (row.run_id == Run.id) & (row.name == metric))
            key = row.value
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
        if metric is None and sort in self.NOT_NULL:
            # plain ASC/DESC so the b-tree index (e.g. ix_runs_created) gives the order
            ordered = key.desc() if descending else key.asc()
        else:
            ordered = key.desc().nulls_last() if descending else key.asc().nulls_last()
        tie = Run.id.desc() if descending else Run.id.asc()
        stmt = stmt.order_by(ordered, tie).limit(limit).offset(offset)
        total = self.session.scalar(select(func.count()).select_from(Run).where(*conds)) or 0
        found = self.session.execute(stmt).all()
        return [(run, name, apc) for run, name, apc in found], total

    def distinct_models(self, limit: int = 200) -> list[str]:
        """Model ids present in the run history, alphabetical: a recursive skip scan over
        ``ix_runs_model_created`` (one index probe per distinct model)."""
        rows = self.session.execute(
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
