"""On-demand node parity checks (``POST /api/v1/cluster/parity``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.core.models import ParityCheck
from orchestrator.core.repositories.base import utcnow


class ParityCheckRepository:
    """On-demand parity checks: stored by the API, answered by an orchestrator."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, request: dict[str, Any]) -> ParityCheck:
        check = ParityCheck(request=request, status="pending")
        self.session.add(check)
        self.session.flush()
        return check

    def get(self, check_id: str) -> ParityCheck | None:
        return self.session.get(ParityCheck, check_id)

    def claim_next(self, orchestrator_id: str) -> ParityCheck | None:
        """The oldest pending check, marked ``running`` (``FOR UPDATE SKIP LOCKED``)."""
        check = self.session.scalars(
            select(ParityCheck)
            .where(ParityCheck.status == "pending")
            .order_by(ParityCheck.created_at)
            .limit(1)
            .with_for_update(skip_locked=True)
        ).first()
        if check is not None:
            check.status = "running"
            check.claimed_by = orchestrator_id
            self.session.flush()
        return check

    def finish(
        self, check: ParityCheck, report: dict[str, Any] | None, error: str | None = None
    ) -> None:
        check.status = "done" if error is None else "failed"
        check.report = report
        check.error = error
        check.finished_at = utcnow()
        self.session.flush()
