"""Orchestrators' heartbeats (liveness and the cluster resources they publish)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from orchestrator.core.models import Orchestrator
from orchestrator.core.repositories.base import utcnow


class OrchestratorRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def heartbeat(self, orchestrator_id: str, hostname: str, resources: dict[str, Any]) -> None:
        """Insert or refresh this orchestrator's row (``INSERT ... ON CONFLICT``)."""
        now = utcnow()
        stmt = pg_insert(Orchestrator).values(
            id=orchestrator_id, hostname=hostname, heartbeat_at=now, resources=resources
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[Orchestrator.id],
            set_={"heartbeat_at": now, "resources": resources},
        )
        self.session.execute(stmt)

    def live_resources(self, stale_after_s: float) -> list[dict[str, Any]]:
        """The resources documents of the orchestrators whose heartbeat is younger than
        ``stale_after_s`` seconds (read by :mod:`orchestrator.experiments.cluster_view`)."""
        cutoff = utcnow() - timedelta(seconds=stale_after_s)
        rows = self.session.scalars(
            select(Orchestrator.resources).where(Orchestrator.heartbeat_at >= cutoff)
        ).all()
        return [dict(r) for r in rows]
