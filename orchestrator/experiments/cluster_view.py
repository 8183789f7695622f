"""What planning reads about the live cluster: the orchestrators' heartbeats.

The heartbeats are read through :class:`orchestrator.core.repositories.OrchestratorRepository`
and interpreted by the pure functions of :mod:`orchestrator.cluster.placement`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from orchestrator.cluster.placement import (
    NodeInventory,
    devices_from_heartbeats,
    kind_from_heartbeats,
    nodes_from_heartbeats,
)
from orchestrator.core.repositories import OrchestratorRepository
from orchestrator.core.settings import Settings


@dataclass
class ClusterView:
    """The live cluster as submissions check against it.

    ``devices``/``nodes`` None: unknown, not checked; ``kind`` None: the device kind
    is not checked (the default view checks nothing).
    """

    devices: int | None = None
    nodes: list[NodeInventory] | None = None
    kind: str | None = None

    @classmethod
    def read(cls, session: Session, settings: Settings) -> ClusterView:
        """The view the live orchestrators publish (heartbeats younger than
        ``orchestrator.stale_after_s``), for the device kind ``orchestrator.device_resource``."""
        resource, stale = settings.orchestrator.device_resource, settings.orchestrator.stale_after_s
        docs = OrchestratorRepository(session).live_resources(stale)
        return cls(
            devices=devices_from_heartbeats(docs, resource),
            nodes=nodes_from_heartbeats(docs),
            kind=kind_from_heartbeats(docs, resource),
        )
