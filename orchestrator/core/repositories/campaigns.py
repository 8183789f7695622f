"""Tuning campaigns and the runs they planned (:mod:`orchestrator.tuning.service`)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from orchestrator.core.models import Campaign, Run

#: Statuses of a campaign that the dispatcher still advances.
ADVANCING = ("queued", "running")
#: Statuses a campaign never leaves.
ENDED = ("succeeded", "failed", "cancelled")


class CampaignRepository:
    """Campaigns, and their runs by label."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, campaign: Campaign) -> Campaign:
        self.session.add(campaign)
        self.session.flush()
        self.session.refresh(campaign)
        return campaign

    def get(
        self, campaign_id: str, *, for_update: bool = False, skip_locked: bool = False
    ) -> Campaign | None:
        """The campaign; ``for_update`` row-locks it (``skip_locked``: None when another
        transaction holds the lock), reading it afresh."""
        if not for_update:
            return self.session.get(Campaign, campaign_id)
        return self.session.scalars(
            select(Campaign)
            .where(Campaign.id == campaign_id)
            .with_for_update(skip_locked=skip_locked)
            .execution_options(populate_existing=True)
        ).one_or_none()

    def page(
        self, *, limit: int, offset: int, status: str | None = None
    ) -> tuple[Sequence[Campaign], int]:
        """Newest first; only campaigns in ``status`` when given; and the count of all."""
        where = [Campaign.status == status] if status else []
        total = self.session.scalar(select(func.count()).select_from(Campaign).where(*where)) or 0
        rows = self.session.scalars(
            select(Campaign)
            .where(*where)
            .order_by(Campaign.created_at.desc(), Campaign.id)
            .limit(limit)
            .offset(offset)
        ).all()
        return rows, total

    def advancing_ids(self) -> list[str]:
        """Ids of the campaigns still to advance (queued or running), oldest first."""
        return list(
            self.session.scalars(
                select(Campaign.id)
                .where(Campaign.status.in_(ADVANCING))
                .order_by(Campaign.created_at, Campaign.id)
            ).all()
        )

    def runs(self, campaign_id: str) -> list[Run]:
        """The campaign's runs, in the order they were queued."""
        return list(
            self.session.scalars(
                select(Run)
                .where(Run.campaign_id == campaign_id)
                .order_by(Run.created_at, Run.experiment_id, Run.sequence)
                .execution_options(populate_existing=True)
            ).all()
        )

    def run_counts(self, campaign_ids: list[str]) -> dict[str, int]:
        """Campaign id -> how many runs it has queued so far."""
        if not campaign_ids:
            return {}
        rows = self.session.execute(
            select(Run.campaign_id, func.count())
            .where(Run.campaign_id.in_(campaign_ids))
            .group_by(Run.campaign_id)
        ).all()
        return {cid: int(n) for cid, n in rows if cid is not None}

    def touch(self, campaign: Campaign) -> None:
        """Set ``updated_at`` to now (the database's clock) and write the changes."""
        campaign.updated_at = func.now()  # type: ignore[assignment]
        self.session.flush()
        self.session.refresh(campaign)
