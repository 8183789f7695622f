"""Schedules and their fires (scheduled sweeps)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from orchestrator.core.models import Run, Schedule, ScheduleFire, new_id
from orchestrator.core.states import ACTIVE


class ScheduleRepository:
    """Schedules and their fires (scheduled sweeps, :mod:`orchestrator.schedules.service`)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, schedule: Schedule) -> Schedule:
        self.session.add(schedule)
        self.session.flush()
        return schedule

    def get(self, schedule_id: str) -> Schedule | None:
        return self.session.get(Schedule, schedule_id)

    def reload(self, schedule: Schedule) -> None:
        """Write ``schedule``'s changes and read it back (server defaults, timestamps)."""
        self.session.flush()
        self.session.refresh(schedule)

    def by_name(self, name: str) -> Schedule | None:
        return self.session.scalar(select(Schedule).where(Schedule.name == name))

    def page(self, *, limit: int, offset: int) -> tuple[Sequence[Schedule], int]:
        total = self.session.scalar(select(func.count()).select_from(Schedule)) or 0
        rows = self.session.scalars(
            select(Schedule)
            .order_by(Schedule.created_at.desc(), Schedule.id)
            .limit(limit)
            .offset(offset)
        ).all()
        return rows, total

    def delete(self, schedule: Schedule) -> None:
        self.session.delete(schedule)
        self.session.flush()

    def due_ids(self, now: datetime) -> list[str]:
        """Ids of enabled schedules whose ``next_fire_at`` is at or before ``now`` (indexed)."""
        return list(
            self.session.scalars(
                select(Schedule.id)
                .where(Schedule.enabled.is_(True), Schedule.next_fire_at <= now)
                .order_by(Schedule.next_fire_at)
            ).all()
        )

    def lock(self, schedule_id: str) -> Schedule | None:
        """The schedule, row-locked; None when missing or another transaction holds it."""
        return self.session.scalars(
            select(Schedule)
            .where(Schedule.id == schedule_id)
            .with_for_update(skip_locked=True)
            .execution_options(populate_existing=True)
        ).one_or_none()

    def insert_fire(
        self,
        schedule_id: str,
        fire_time: datetime,
        status: str,
        detail: str | None = None,
    ) -> ScheduleFire | None:
        """Insert the fire row unless ``(schedule_id, fire_time)`` exists; None if it did.

        ``INSERT ... ON CONFLICT DO NOTHING``: of concurrent inserters exactly
        one gets the row (the others wait for its transaction, then get None).
        """
        fire_id = self.session.scalar(
            pg_insert(ScheduleFire)
            .values(
                id=new_id(),
                schedule_id=schedule_id,
                fire_time=fire_time,
                status=status,
                detail=detail,
            )
            .on_conflict_do_nothing(constraint="uq_schedule_fires_schedule_time")
            .returning(ScheduleFire.id)
        )
        return None if fire_id is None else self.session.get(ScheduleFire, fire_id)

    def fires(
        self, schedule_id: str, *, limit: int, offset: int
    ) -> tuple[Sequence[ScheduleFire], int]:
        """The schedule's fires, newest fire time first, and their total."""
        cond = ScheduleFire.schedule_id == schedule_id
        total = self.session.scalar(select(func.count()).select_from(ScheduleFire).where(cond))
        rows = self.session.scalars(
            select(ScheduleFire)
            .where(cond)
            .order_by(ScheduleFire.fire_time.desc())
            .limit(limit)
            .offset(offset)
        ).all()
        return rows, int(total or 0)

    def fired_before(
        self, schedule_id: str, before: datetime | None, limit: int = 20
    ) -> Sequence[ScheduleFire]:
        """Fires with an experiment (``fired``) before ``before`` (all if None), newest first."""
        conds = [
            ScheduleFire.schedule_id == schedule_id,
            ScheduleFire.status == "fired",
            ScheduleFire.experiment_id.is_not(None),
        ]
        if before is not None:
            conds.append(ScheduleFire.fire_time < before)
        return self.session.scalars(
            select(ScheduleFire).where(*conds).order_by(ScheduleFire.fire_time.desc()).limit(limit)
        ).all()

    def campaign_fires_before(
        self, schedule_id: str, before: datetime | None, limit: int = 20
    ) -> Sequence[ScheduleFire]:
        """Fires that started a campaign before ``before`` (all if None), newest first."""
        conds = [ScheduleFire.schedule_id == schedule_id, ScheduleFire.campaign_id.is_not(None)]
        if before is not None:
            conds.append(ScheduleFire.fire_time < before)
        return self.session.scalars(
            select(ScheduleFire).where(*conds).order_by(ScheduleFire.fire_time.desc()).limit(limit)
        ).all()

    def has_active_runs(self, experiment_id: str) -> bool:
        """Whether the experiment has a run that is not terminal."""
        return bool(
            self.session.scalar(
                select(func.count())
                .select_from(Run)
                .where(
                    Run.experiment_id == experiment_id,
                    Run.status.in_(sorted(ACTIVE)),
                )
            )
        )
