"""Scheduled campaigns: a schedule that holds a campaign request re-tunes on its cron.

A campaign schedule's ``campaign`` is a campaign request as ``POST /api/v1/campaigns``
takes it (:class:`orchestrator.tuning.campaign_request.CampaignRequest`). It is checked
when the schedule is saved (:func:`check_campaign`) and, at each fire, submitted through
the same intake (:func:`orchestrator.tuning.intake.accept_campaign`,
:func:`prepare_campaign`): the campaign is stored in the transaction that inserts the fire
row and links it (``schedule_fires.campaign_id``), so exactly one campaign starts per
fire time; a campaign prepared for a fire time another orchestrator took is deleted
before that transaction commits.

When a fired campaign has ended, :func:`campaign_movement` compares its final
configuration with the one of the previous fired campaign of the schedule that ended
``succeeded``: the best configuration **moved** (which variables changed, from -> to) or
**held**. Computed on read (an ended campaign's result no longer changes).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from orchestrator.core.errors import CampaignInvalidError, VlabError
from orchestrator.core.models import Campaign, Schedule, ScheduleFire
from orchestrator.core.repositories import CampaignRepository, ScheduleRepository
from orchestrator.core.repositories.campaigns import ADVANCING, ENDED
from orchestrator.core.settings import Settings
from orchestrator.tuning.intake import accept_campaign, checked_campaign

#: What :func:`prepare_campaign` gives a fire: the campaign stored for it, or why none.
Prepared = Campaign | VlabError | None


def _under_campaign(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Problems of a campaign request located under ``["body", "campaign", ...]``."""
    out = []
    for e in errors:
        loc = list(e.get("loc", []))
        rest = loc[1:] if loc[:1] == ["body"] else loc
        out.append({**e, "loc": ["body", "campaign", *rest]})
    return out


def check_campaign(session: Session, settings: Settings, body: dict[str, Any]) -> None:
    """Check campaign request ``body`` as ``POST /api/v1/campaigns`` would (the same
    intake), storing nothing: 422 ``campaign_invalid`` with every problem located under
    ``body.campaign``; 503 when vLLM cannot be asked now. Commits the caller's
    transaction first (the intake asks vLLM with no connection held)."""
    try:
        checked_campaign(session, settings, body)  # checked, not started: one per fire
    except CampaignInvalidError as exc:
        raise CampaignInvalidError(_under_campaign(exc.errors)) from exc


def prepare_campaign(session: Session, settings: Settings, schedule_id: str, now: Any) -> Prepared:
    """For a campaign schedule due at ``now``: its campaign, stored ``queued`` through the
    intake in the session's (new) transaction, or the :class:`VlabError` that refused it
    (the fire is then recorded ``failed``). None for a sweep schedule, one not due, or one
    whose previous campaign still runs under policy ``skip`` (nothing to start)."""
    sched = ScheduleRepository(session).get(schedule_id)
    if (
        sched is None
        or sched.campaign is None
        or not sched.enabled
        or sched.next_fire_at is None
        or sched.next_fire_at > now
        or (sched.concurrency_policy == "skip" and busy_campaign(session, sched) is not None)
    ):
        return None
    name, body = sched.name, dict(sched.campaign)
    try:
        row = accept_campaign(session, settings, body, submitted_by=f"schedule:{name}"[:200])
    except CampaignInvalidError as exc:
        return CampaignInvalidError(_under_campaign(exc.errors))
    except VlabError as exc:
        return exc
    return row


def discard_unused(session: Session, prepared: Prepared, started: list[str | None]) -> None:
    """Delete a campaign prepared for a fire that did not start it (``started``: the
    campaign ids the fires written now link; another orchestrator took the fire time, or
    the fire was skipped)."""
    if isinstance(prepared, Campaign) and prepared.id not in started:
        session.delete(prepared)
        session.flush()


def busy_campaign(session: Session, sched: Schedule) -> str | None:
    """The id of the schedule's latest fired campaign when it is still queued or running."""
    previous = ScheduleRepository(session).campaign_fires_before(sched.id, None, limit=1)
    if not previous or previous[0].campaign_id is None:
        return None
    row = CampaignRepository(session).get(previous[0].campaign_id)
    return row.id if row is not None and row.status in ADVANCING else None


def fire_campaign(
    session: Session, sched: Schedule, fire: ScheduleFire, prepared: Prepared
) -> tuple[str, str | None]:
    """Link the prepared campaign to ``fire`` (just inserted ``fired``): returns the
    fire's ``(status, detail)``: ``failed`` with the intake's refusal, or ``fired``."""
    if isinstance(prepared, Campaign):
        fire.campaign_id = prepared.id
        session.flush()
        return "fired", fire.detail
    if isinstance(prepared, VlabError):
        fire.status, fire.detail = "failed", f"{prepared.code}: {prepared.detail}"[:4000]
    else:  # not prepared (the schedule changed between the two reads): nothing started
        fire.status, fire.detail = "failed", "the schedule changed while firing: no campaign"
    return fire.status, fire.detail


def _final(row: Campaign) -> dict[str, Any]:
    return dict((row.result or {}).get("incumbent") or {})


def _same(a: Any, b: Any) -> bool:
    return bool(a == b and type(a) is type(b))


def configuration_changes(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """The variables whose level differs (``True`` and ``1`` differ): ``{"variable",
    "from_level", "to_level"}``, None where a side has no such variable (the space
    changed); in the order of ``after``, then the variables only ``before`` has."""
    names = [*after, *(k for k in before if k not in after)]
    return [
        {"variable": k, "from_level": before.get(k), "to_level": after.get(k)}
        for k in names
        if k not in before or k not in after or not _same(before[k], after[k])
    ]


def campaign_movement(session: Session, fire: ScheduleFire) -> dict[str, Any] | None:
    """Whether the best configuration moved since the previous fired campaign; None when
    the fire started no campaign.

    Shape: ``{"campaign_id", "campaign_status", "comparison": "pending" | "no_result" |
    "no_previous" | "held" | "moved", "final": {variable: level} | None,
    "serve_command": str | None, "compared_with": {"fire_time", "campaign_id", "final"} |
    None, "changes": [{"variable", "from_level", "to_level"}]}``. ``pending`` while the
    campaign runs; ``no_result`` when it ended other than ``succeeded`` (failed,
    cancelled, or deleted); ``no_previous`` when no earlier fired campaign of the schedule
    succeeded.
    """
    if fire.campaign_id is None:
        return None
    campaigns = CampaignRepository(session)
    row = campaigns.get(fire.campaign_id)
    out: dict[str, Any] = {
        "campaign_id": fire.campaign_id,
        "campaign_status": row.status if row is not None else None,
        "comparison": "pending",
        "final": None,
        "serve_command": None,
        "compared_with": None,
        "changes": [],
    }
    if row is not None and row.status not in ENDED:
        return out
    if row is None or row.status != "succeeded":
        return {**out, "comparison": "no_result"}
    final = _final(row)
    out.update(final=final, serve_command=(row.result or {}).get("serve_command"))
    for cand in ScheduleRepository(session).campaign_fires_before(fire.schedule_id, fire.fire_time):
        prev = campaigns.get(cand.campaign_id) if cand.campaign_id else None
        if prev is not None and prev.status == "succeeded":
            changes = configuration_changes(_final(prev), final)
            return {
                **out,
                "comparison": "moved" if changes else "held",
                "compared_with": {
                    "fire_time": cand.fire_time,
                    "campaign_id": prev.id,
                    "final": _final(prev),
                },
                "changes": changes,
            }
    return {**out, "comparison": "no_previous"}


def describe_movement(movement: dict[str, Any] | None) -> str | None:
    """One line for a person: ``moved: engine_args.max_num_seqs 128 -> 256`` or
    ``held``; None for other comparisons."""
    if movement is None or movement["comparison"] not in ("moved", "held"):
        return None
    if movement["comparison"] == "held":
        return "held: the same best configuration as the previous campaign"
    moved = ", ".join(
        f"{c['variable']} {c['from_level']!r} -> {c['to_level']!r}" for c in movement["changes"]
    )
    return f"moved: {moved}"
