"""Experiments (:class:`orchestrator.core.models.Experiment`)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
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

    def page(self, *, limit: int, offset: int) -> tuple[Sequence[Experiment], int]:
        total = self.session.scalar(select(func.count()).select_from(Experiment)) or 0
        rows = self.session.scalars(
            select(Experiment)
            .order_by(Experiment.created_at.desc(), Experiment.id)
            .limit(limit)
            .offset(offset)
        ).all()
        return rows, total
