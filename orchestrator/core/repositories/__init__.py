"""Every query the service makes lives here, one module per aggregate. Repositories
never commit: the caller owns the transaction (see :func:`orchestrator.core.db.unit_of_work`).
"""

from orchestrator.core.repositories.auth import (
    AuditRepository,
    TokenRepository,
    WebSessionRepository,
)
from orchestrator.core.repositories.base import ping, utcnow
from orchestrator.core.repositories.campaigns import CampaignRepository
from orchestrator.core.repositories.experiments import ExperimentRepository
from orchestrator.core.repositories.history import HistoryRepository
from orchestrator.core.repositories.orchestrators import OrchestratorRepository
from orchestrator.core.repositories.parity_checks import ParityCheckRepository
from orchestrator.core.repositories.runs import RunRepository
from orchestrator.core.repositories.schedules import ScheduleRepository

__all__ = [
    "AuditRepository",
    "CampaignRepository",
    "ExperimentRepository",
    "HistoryRepository",
    "OrchestratorRepository",
    "ParityCheckRepository",
    "RunRepository",
    "ScheduleRepository",
    "TokenRepository",
    "WebSessionRepository",
    "ping",
    "utcnow",
]
