"""Every request and response body of the REST API, one module per resource:

- :mod:`.experiments`: an experiment submitted, listed and read, its comparison, its
  MLflow export (submissions are :class:`orchestrator.experiments.spec.ExperimentSpec`);
- :mod:`.runs`: a run, its metrics, request records, engine events, parity report, a
  variant cloned from it (a run's ``capacity`` is :class:`jobs.capacity.search.CapacityResult`,
  the search's own model);
- :mod:`.schedules`: scheduled sweeps, their fires and regressions;
- :mod:`.campaigns`: tuning campaigns, their path, candidates and confirmation
  (submissions are :class:`orchestrator.tuning.campaign_request.CampaignRequest`);
- :mod:`.cluster`: on-demand node parity checks;
- :mod:`.analyze`: the what-if diagnostics (KV cache, prompt prefixes) and the advisor's
  findings;
- :mod:`.auth`: API tokens, who a request acts as, the audit trail;
- :mod:`.common`: a page of items, ISO 8601 date-times.

Every name is re-exported here: ``from api.schemas import RunOut``.
"""

from __future__ import annotations

from api.schemas.analyze import (
    MAX_GIB,
    MAX_KV_BYTES_PER_TOKEN,
    ContextCap,
    ExperimentFindings,
    FittingContext,
    IgnoredKey,
    KVCacheAnalysis,
    KVCacheEstimate,
    KVCacheGroup,
    KVCacheQuery,
    KVEngine,
    KVMemory,
    ModelName,
    PrefixAnalysis,
    PrefixQuery,
    RunFindings,
)
from api.schemas.auth import (
    AuditOut,
    AuditPage,
    Me,
    TokenCreated,
    TokenIn,
    TokenOut,
)
from api.schemas.campaigns import (
    CampaignCandidateOut,
    CampaignConfirmationOut,
    CampaignGain,
    CampaignListItem,
    CampaignMlflowExportOut,
    CampaignMlflowExportRequest,
    CampaignOut,
    CampaignRunOut,
    CampaignSpaceNoteOut,
    CampaignStepOut,
    CampaignWallTimeOut,
)
from api.schemas.cluster import (
    ParityCheckOut,
    ParityCheckRequest,
)
from api.schemas.common import (
    IsoDatetime,
    Page,
)
from api.schemas.experiments import (
    ChainLink,
    ExperimentComparison,
    ExperimentCreated,
    ExperimentListItem,
    ExperimentOut,
    MlflowExportOut,
    MlflowExportRequest,
    MlflowRunExportOut,
    SucceededRepeats,
    VariantComparison,
)
from api.schemas.runs import (
    ENGINE_EVENT_TYPES,
    CapacityResult,
    EngineEventOut,
    EngineEventsSummary,
    RequestOut,
    RunBrief,
    RunEventsOut,
    RunMetricsOut,
    RunOut,
    RunParityOut,
    SampleOut,
    VariantIn,
)
from api.schemas.schedules import (
    FireBrief,
    FireOut,
    Regression,
    ScheduleIn,
    ScheduleOut,
    ScheduleUpdate,
    Withheld,
)

__all__ = [
    "AuditOut",
    "AuditPage",
    "CampaignCandidateOut",
    "CampaignConfirmationOut",
    "CampaignGain",
    "CampaignListItem",
    "CampaignMlflowExportOut",
    "CampaignMlflowExportRequest",
    "CampaignOut",
    "CampaignRunOut",
    "CampaignSpaceNoteOut",
    "CampaignStepOut",
    "CampaignWallTimeOut",
    "CapacityResult",
    "ChainLink",
    "ContextCap",
    "ENGINE_EVENT_TYPES",
    "EngineEventOut",
    "EngineEventsSummary",
    "ExperimentComparison",
    "ExperimentCreated",
    "ExperimentFindings",
    "ExperimentListItem",
    "ExperimentOut",
    "FireBrief",
    "FireOut",
    "FittingContext",
    "IgnoredKey",
    "IsoDatetime",
    "KVCacheAnalysis",
    "KVCacheEstimate",
    "KVCacheGroup",
    "KVCacheQuery",
    "KVEngine",
    "KVMemory",
    "MAX_GIB",
    "MAX_KV_BYTES_PER_TOKEN",
    "Me",
    "MlflowExportOut",
    "MlflowExportRequest",
    "MlflowRunExportOut",
    "ModelName",
    "Page",
    "ParityCheckOut",
    "ParityCheckRequest",
    "PrefixAnalysis",
    "PrefixQuery",
    "Regression",
    "RequestOut",
    "RunBrief",
    "RunEventsOut",
    "RunFindings",
    "RunMetricsOut",
    "RunOut",
    "RunParityOut",
    "SampleOut",
    "ScheduleIn",
    "ScheduleOut",
    "ScheduleUpdate",
    "SucceededRepeats",
    "TokenCreated",
    "TokenIn",
    "TokenOut",
    "VariantComparison",
    "VariantIn",
    "Withheld",
]
