"""How many of a campaign's runs measure at once, each on its own devices (issue 25, cost).

A campaign's cycles are measured **side by side** when the cluster holds every
configuration of a cycle at once: the core (:class:`orchestrator.campaigns.loop.Campaign`,
``slots``) then plans several pairs at once, each configuration's runs in a row so that the
dispatcher's batching (:meth:`orchestrator.core.repositories.runs.RunRepository.claim_server_mates`)
serves them from one vLLM server, and the configurations run together on other devices.

The slots are fixed at the campaign's first advance and kept with it (``result["slots"]``),
so a replay plans as the first pass did whatever the cluster says later:

- the runs the dispatcher runs together (``orchestrator.max_concurrent_runs``);
- the live cluster's devices over the most devices a configuration of the space reserves
  (TP x PP, or ``layout.devices``, at the space's largest layout levels);
- GPUs only: on a CPU host the runs would share its cores and memory bandwidth, so the
  campaign interleaves them on one slot;
- 1 when the cluster is not known, or for a campaign that queued runs before slots were kept.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from orchestrator.core.models import Campaign
from orchestrator.core.settings import Settings
from orchestrator.experiments.cluster_view import ClusterView
from orchestrator.experiments.spec import Layout
from orchestrator.tuning.campaign_request import CampaignRequest


def kept_slots(row: Campaign) -> int | None:
    """The slots kept with the campaign, None when none were kept yet."""
    value = (row.result or {}).get("slots")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def campaign_slots(
    session: Session,
    settings: Settings | None,
    row: Campaign,
    request: CampaignRequest,
    started: bool,
) -> int:
    """The campaign's slots: those kept, else (``started``: it has runs already) 1, else
    what the cluster holds now (see the module docstring)."""
    kept = kept_slots(row)
    if kept is not None:
        return kept
    if started or settings is None or settings.orchestrator.max_concurrent_runs < 2:
        return 1
    view = ClusterView.read(session, settings)
    if view.devices is None or (view.kind or "").upper() != "GPU":
        return 1
    try:
        per_run = max(widest_layout(request).reserved, 1)
    except ValueError:  # no such layout: the experiment checks say why
        return 1
    return max(1, min(settings.orchestrator.max_concurrent_runs, view.devices // per_run))


def widest_layout(request: CampaignRequest) -> Layout:
    """The baseline's layout with each ``layout.*`` variable of the space at its largest
    level: the most devices one run of the campaign reserves."""
    layout: dict[str, Any] = dict(request.baseline.get("layout") or {})
    for v in request.variables():
        section, _, name = v.name.partition(".")
        numbers = [x for x in v.levels if isinstance(x, int) and not isinstance(x, bool)]
        if section == "layout" and numbers:
            layout[name] = max(numbers)
    return Layout.model_validate(layout)
