"""Experiments (:class:`orchestrator.core.models.Experiment`)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from orchestrator.core.models import Experiment


class ExperimentRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, experiment: Experiment) -> Experiment:
        self.session.add(experiment)
        self.session.flush()
        return experiment

    def get(
        self, experiment_id: str, *, for_update: bool = False, fresh: bool = False
    ) -> Experiment | None:
        """The experiment; ``for_update``: row-locked; ``fresh``: its loaded attributes are
        read again from the database (``populate_existing``)."""
        return self.session.get(
            Experiment, experiment_id, with_for_update=for_update or None, populate_existing=fresh
        )

    def reload(self, experiment: Experiment) -> None:
        """Read ``experiment`` (and its runs, when next used) again from the database."""
        self.session.refresh(experiment)

    def forget_runs(self, experiment: Experiment) -> None:
        """Drop the loaded ``experiment.runs``: the next use reads them as they are now."""
        self.session.expire(experiment, ["runs"])

    #: lists of more experiments than this give the statistics' count (pg_class.reltuples)
    EXACT_COUNT_UP_TO = 10_000
    #: whether the last :meth:`page`'s total was the statistics' estimate
    estimated = False

    def page(self, *, limit: int, offset: int) -> tuple[Sequence[Experiment], int]:
        """The newest experiments first, and how many there are: exact up to
        :attr:`EXACT_COUNT_UP_TO`, above the table's size from its statistics
        (then :attr:`estimated` is set), not a scan of every row."""
        total, self.estimated = self._count()
        rows = self.session.scalars(
            select(Experiment)
            .order_by(Experiment.created_at.desc(), Experiment.id.desc())
            .limit(limit)
            .offset(offset)
        ).all()
        return rows, total

    def _count(self) -> tuple[int, bool]:
        estimate = self.session.scalar(
            text("SELECT reltuples::bigint FROM pg_class WHERE oid = 'experiments'::regclass")
        )
        if estimate is not None and estimate > self.EXACT_COUNT_UP_TO:
            return int(estimate), True
        return self.session.scalar(select(func.count()).select_from(Experiment)) or 0, False
