"""Whether a campaign's run was lost to the infrastructure or failed by its configuration.

A run **lost** says nothing of its configuration, and the campaign measures it again
(:mod:`orchestrator.campaigns.loop`); a run that **failed** (an engine that refuses the
configuration, runs out of memory or does not start; a request list that cannot be built)
is the configuration's failure. Lost is, of a run that ended ``failed``:

- one the dispatcher ended because its supervisor is gone (its orchestrator died or
  restarted, its supervisor died, stopped answering or returned no result for it):
  :func:`orchestrator.dispatch.lost_runs.fail_lost` marks it with
  ``engine_info["recovered"]`` (the structured mark, read first);
- one whose launch raised before anything ran (``launch failed: ...``: a placement group
  that was never ready, a Ray error; a shape the cluster can never hold is refused with
  another message, and stays a failure);
- one whose multi-node part's node was lost (``node rank N (...) was lost: ...``).

A cancelled or blocked run is not lost (it is someone's decision, or a cluster that will
refuse it again).
"""

from __future__ import annotations

import re

from orchestrator.core.models import Run
from orchestrator.core.states import RunStatus

#: Error texts of runs lost before or outside their engine (see the module docstring).
LOST_ERRORS = (
    re.compile(r"^launch failed: "),
    re.compile(r"^(supervisor error: )?node rank \d+ \(.*\) was lost: "),
)


def lost_to_infrastructure(run: Run) -> bool:
    """True when ``run`` ended failed because the infrastructure lost it."""
    return loss_of(run) is not None


def loss_of(run: Run) -> str | None:
    """How the infrastructure lost ``run`` (the dispatcher's reason for a run whose
    supervisor is gone, or the launch or node error), None when it did not."""
    if run.status != RunStatus.FAILED.value:
        return None
    texts = (run.status_reason or "", run.error or "")
    if "recovered" in (run.engine_info or {}):
        return next((t for t in texts if t), "its supervisor is gone")
    return next((t for t in texts for p in LOST_ERRORS if p.match(t)), None)
