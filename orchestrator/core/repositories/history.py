"""The run history: filtered, sorted pages of runs (:mod:`orchestrator.runs.history`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    and_,
    func,
    or_,
    select,
    text,
    tuple_,
    type_coerce,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session, load_only
from sqlalchemy.sql.expression import ClauseElement, Executable

from orchestrator.core.models import RUN_SORT_METRICS, Experiment, Run, RunMetric

#: The GIN trigram index on ``experiments.name`` (``pg_trgm``, migration 0014) that
#: serves the experiment filter's ``ILIKE '%needle%'``. Optional, so not in the ORM
#: models: it exists only on a server with the extension (not the embedded PostgreSQL).
NAME_TRIGRAM_INDEX = "ix_experiments_name_trgm"


@dataclass
class HistorySlice:
    """A page of the run history: ``(run, experiment name, enable_prefix_caching)`` rows
    (the third the run's engine argument, None when unset), how many runs match
    (``estimated``: an estimate, see :meth:`HistoryRepository._count`), and the sort
    values of the last row when a next page may follow (``after`` of the next call)."""

    rows: list[tuple[Run, str, Any]]
    total: int
    estimated: bool
    next_key: list[Any] | None


class _Explain(Executable, ClauseElement):
    """``EXPLAIN (FORMAT JSON) <statement>``, its parameters bound as the statement's."""

    inherit_cache = False

    def __init__(self, statement: Any) -> None:
        self.statement = statement


@compiles(_Explain, "postgresql")
def _compile_explain(element: _Explain, compiler: Any, **kw: Any) -> str:
    return "EXPLAIN (FORMAT JSON) " + str(compiler.process(element.statement, **kw))


class _Walk:
    """A page's rows by a deferred join: the page's run ids (and sort values) first, over
    the runs (and, when a key or condition needs it, experiments) alone, in the sort's
    index order, so ``OFFSET`` skips index entries, not joined rows; then the full rows
    of those ids. Rows: ``(run, experiment name, enable_prefix_caching, *sort values)``."""

    def __init__(
        self,
        session: Session,
        conds: list[ColumnElement[bool]],
        keys: list[tuple[Any, bool]],
        join: bool,
        brief: bool,
    ) -> None:
        self.session = session
        self.conds = conds
        self.keys = keys
        self.join = join  # a key or condition reads the experiment
        self.brief = brief

    def rows(self, where: list[Any], by: int, limit: int, offset: int) -> list[Any]:
        """The rows matching ``where`` too, ordered by the first ``by`` keys (``-1``: the
        tie-break alone), ``limit`` of them after ``offset``."""
        if limit <= 0:
            return []
        order = self.keys[:by] if by > 0 else self.keys[-1:]
        labelled = [k.label(f"k{i}") for i, (k, _) in enumerate(self.keys)]
        ids: Any = select(Run.id.label("rid"), *labelled)
        if self.join:
            ids = ids.join(Experiment, Experiment.id == Run.experiment_id)
        ids = (
            ids.where(*self.conds, *where)
            .order_by(*(k.desc() if d else k.asc() for k, d in order))
            .limit(limit)
            .offset(offset)
            .subquery()
        )
        cols = [ids.c[f"k{i}"] for i in range(len(self.keys))]
        pos = list(range(by)) if by > 0 else [len(self.keys) - 1]
        stmt: Any = (
            select(
                Run,
                Experiment.name,
                type_coerce(Run.engine_args, JSONB)["enable_prefix_caching"],
                *cols,
            )
            .join(ids, ids.c.rid == Run.id)
            .join(Experiment, Experiment.id == Run.experiment_id)
            .order_by(*(cols[i].desc() if self.keys[i][1] else cols[i].asc() for i in pos))
        )
        if self.brief:
            stmt = stmt.options(load_only(*HistoryRepository.TABLE_COLUMNS, raiseload=True))
        return list(self.session.execute(stmt).all())


class HistoryRepository:
    """The run history (:mod:`orchestrator.runs.history`): filtered, sorted pages of runs.

    One query per page (two when a sort key may be NULL: the rows with a value, then
    those without), runs joined to their experiment (for its name), walking an index in
    the sort's order: ``experiments(created_at, id)`` (or ``(name, id)``) then
    ``runs(experiment_id, sequence, id)`` for the default order (and by experiment),
    ``runs(<sort key>, id)`` for a metric (the ``sort_*`` columns, migration 0013) and
    every other column;
    filters by ``runs(status, created_at)``, ``runs(model_id, created_at)``, the GIN
    index on ``runs.engine_args`` (``@>``), the experiment's name by
    :data:`NAME_TRIGRAM_INDEX` where the server has ``pg_trgm`` (else a scan of the
    experiments). Deep pages go by keyset (``after``), counts
    above :attr:`EXACT_COUNT_UP_TO` are estimated. Figures: docs/BENCHMARKS.md.
    """

    #: sort keys of columns that are never NULL (one index walk)
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
        run: Any = Run,
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
            conds.append(run.experiment_id == experiment_id)
        if model:
            conds.append(run.model_id == model)
        if status:
            conds.append(run.status == status)
        if experiment:
            needle = experiment.replace("\\", "\\\\").replace("%", r"\%").replace("_", r"\_")
            # a subquery over the (much smaller) experiments table, then the runs by
            # ix_runs_experiment_position, instead of filtering every joined run; the
            # name's substring (case-insensitive, % and _ literal) from the trigram index
            # NAME_TRIGRAM_INDEX where there is one (a needle of 3+ characters), else a
            # scan of every experiment's name
            matching = select(Experiment.id).where(
                (Experiment.id == experiment) | Experiment.name.ilike(f"%{needle}%", escape="\\")
            )
            conds.append(run.experiment_id.in_(matching))
        if engine_arg:
            name, value = engine_arg
            conds.append(type_coerce(run.engine_args, JSONB).contains({name: value}))
        if since:
            conds.append(run.created_at >= since)
        if until:
            conds.append(run.created_at < until)
        return conds

    def _order(self, sort: str, descending: bool) -> tuple[list[tuple[Any, bool]], bool]:
        """The ORDER BY of ``sort``: ``(expression, descending)`` keys, the last one the
        tie-break, and whether the first key may be NULL (such rows come last)."""
        if sort in ("submitted", "experiment"):
            # the newest experiment (or by name) first, its runs together in start order
            # (ix_experiments_created or ix_experiments_name, then
            # ix_runs_experiment_sequence)
            first = Experiment.created_at if sort == "submitted" else Experiment.name
            return [
                (first, descending),
                (Experiment.id, descending),
                (Run.sequence, False),
                (Run.id, False),
            ], False
        if sort in RUN_SORT_METRICS.values():
            key: Any = getattr(Run, sort)
        else:
            key = {
                "sequence": Run.sequence,
                "started": Run.started_at,
                "duration": Run.finished_at - Run.started_at,
                "model": Run.model_id,
                "status": Run.status,
                "variable": Run.variable,
            }[sort]
        return [(key, descending), (Run.id, descending)], sort not in self.NOT_NULL

    @staticmethod
    def _seek(keys: list[tuple[Any, bool]], values: list[Any]) -> ColumnElement[bool]:
        """Rows after ``values`` in the order of ``keys`` (a keyset cursor's condition):
        one row comparison when every key runs the same way, else the expanded OR, with
        the first key's bound up front either way so its index can seek to it."""
        first, first_desc = keys[0]
        lead = first <= values[0] if first_desc else first >= values[0]
        if len({d for _, d in keys}) == 1:
            row, at = tuple_(*(k for k, _ in keys)), tuple_(*values)
            return and_(lead, row < at if first_desc else row > at)
        ors = [
            and_(
                *(k == v for (k, _), v in zip(keys[:i], values[:i], strict=True)),
                key < values[i] if desc else key > values[i],
            )
            for i, (key, desc) in enumerate(keys)
        ]
        return and_(lead, or_(*ors))

    def page(
        self,
        filters: dict[str, Any],
        *,
        sort: str,
        descending: bool,
        limit: int,
        offset: int = 0,
        after: list[Any] | None = None,
        brief: bool = False,
        count: bool = True,
    ) -> HistorySlice:
        """One page of runs matching ``filters`` and how many match.

        ``filters``: the fields of ``orchestrator.runs.history.HistoryFilter``. ``sort``: a
        column key (``submitted``: the newest experiment first, each experiment's runs
        together in start order; ``sequence``, ``started``, ``duration``, ``experiment``,
        ``model``, ``status``, ``variable``) or a sort-key column of
        :data:`RUN_SORT_METRICS`; rows without the sort value come last in either
        direction. The page starts ``offset`` rows in, or (a keyset cursor) right after
        the row whose sort values are ``after`` (a previous slice's ``next_key``), which
        costs the same at any depth. ``brief``: the runs carry only
        :data:`TABLE_COLUMNS` (reading another attribute raises). ``count``: also count
        the matching runs (exactly up to :attr:`EXACT_COUNT_UP_TO`, else estimated).
        """
        run_conds = self._conditions(**filters)
        keys, nullable = self._order(sort, descending)
        conds = list(run_conds)
        if filters.get("until") and sort == "submitted":
            # implied (a run is created at or after its experiment), for the planner: the
            # default order's walk over experiments starts at the range, not at the newest
            conds.append(Experiment.created_at < filters["until"])
        walk = _Walk(self.session, conds, keys, sort in ("submitted", "experiment"), brief)
        found: list[Any] = []
        if not nullable:
            seek = [self._seek(keys, after)] if after is not None else []
            found = walk.rows(seek, len(keys), limit, offset)
        else:
            # two index walks instead of NULLS LAST (which no b-tree direction gives):
            # the rows with a value, then those without it, by id
            key, tie = keys[0][0], keys[-1]
            in_nulls = after is not None and after[0] is None
            if not in_nulls:
                seek = [self._seek(keys, after)] if after is not None else []
                found = walk.rows([key.is_not(None), *seek], len(keys), limit, offset)
            if len(found) < limit:
                where, skip = [key.is_(None)], 0
                if in_nulls and after is not None:
                    where.append(self._seek([tie], after[-1:]))
                    skip = offset
                elif offset and not found:  # the page starts past the rows with a value
                    valued = select(func.count()).select_from(Run).where(*conds, key.is_not(None))
                    skip = max(0, offset - (self.session.scalar(valued) or 0))
                found += walk.rows(where, -1, limit - len(found), skip)
        rows = [(row[0], row[1], row[2]) for row in found]
        next_key = list(found[-1][3:]) if len(found) == limit else None
        total, estimated = self._count(run_conds) if count else (0, False)
        return HistorySlice(rows=rows, total=total, estimated=estimated, next_key=next_key)

    #: counts up to this many matching runs are exact; above, an estimate
    EXACT_COUNT_UP_TO = 1000

    def _count(self, conds: list[ColumnElement[bool]]) -> tuple[int, bool]:
        """``(count, estimated)``: the planner's estimate of the matching rows (``EXPLAIN``,
        from the table's statistics: a millisecond at any size) when it is over ten times
        :attr:`EXACT_COUNT_UP_TO`; else a count that stops past that bound, exact when
        it stops short of it, else the estimate (never below the bound)."""
        cap = self.EXACT_COUNT_UP_TO
        plan = self.session.execute(_Explain(select(Run.id).where(*conds))).scalar_one()
        guess = int(plan[0]["Plan"]["Plan Rows"])
        analysed = self.session.scalar(
            text("SELECT reltuples >= 0 FROM pg_class WHERE oid = 'runs'::regclass")
        )
        if analysed and guess > 10 * cap:
            return guess, True
        bounded = select(Run.id).where(*conds).limit(cap + 1).subquery()
        exact = self.session.scalar(select(func.count()).select_from(bounded)) or 0
        if exact <= cap:
            return exact, False
        if not analysed:  # no statistics yet: the estimate means nothing
            everything = select(func.count()).select_from(Run).where(*conds)
            return self.session.scalar(everything) or 0, False
        return max(guess, cap + 1), True

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

    #: An export's run row: field -> column (the order of the export's columns)
    EXPORT_FIELDS = {
        "id": Run.id,
        "experiment_id": Run.experiment_id,
        "variant": Run.name,
        "repeat_index": Run.repeat_index,
        "sequence": Run.sequence,
        "status": Run.status,
        "started_at": Run.started_at,
        "finished_at": Run.finished_at,
        "model_id": Run.model_id,
        "model_digest": Run.model_digest,
        "max_model_len": Run.max_model_len,
        "request_list_hash": Run.request_list_hash,
        "vllm_version": Run.vllm_version,
        "layout": Run.layout,
        "workload": Run.workload,
        "engine_args": Run.explicit_engine_args,
    }

    def experiment_exists(self, experiment_id: str) -> bool:
        """Whether there is an experiment ``experiment_id`` (its runs not loaded)."""
        found = self.session.scalar(select(Experiment.id).where(Experiment.id == experiment_id))
        return found is not None

    def export_rows(self, experiment_id: str, batch_size: int) -> Iterator[list[dict[str, Any]]]:
        """The runs of ``experiment_id`` in their order (position), ``batch_size`` at a
        time, each a dict of :attr:`EXPORT_FIELDS` and ``metrics`` (its summary metrics
        by name): read through a server-side cursor (and the batch's metrics by one
        query), so memory holds one batch whatever the number of runs."""
        names = list(self.EXPORT_FIELDS)
        result = self.session.execute(
            select(*(col.label(name) for name, col in self.EXPORT_FIELDS.items()))
            .where(Run.experiment_id == experiment_id)
            .order_by(Run.position, Run.id),
            execution_options={"yield_per": batch_size},
        )
        with result:
            for part in result.partitions():
                rows = [dict(zip(names, row, strict=True)) for row in part]
                metrics: dict[str, dict[str, float]] = {row["id"]: {} for row in rows}
                for rid, name, value in self.session.execute(
                    select(RunMetric.run_id, RunMetric.name, RunMetric.value).where(
                        RunMetric.run_id.in_(list(metrics))
                    )
                ):
                    metrics[rid][name] = value
                for row in rows:
                    row["metrics"] = metrics[row["id"]]
                yield rows
