"""``/api/v1/schedules``: scheduled sweeps, their fire times and their fires with
regressions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from sqlalchemy.orm import Session

from api.deps import SessionDep, SettingsDep
from api.routes.common import Limit, Offset, url_for_id
from api.schemas import FireBrief, FireOut, Page, ScheduleIn, ScheduleOut, ScheduleUpdate
from api.schemas.schedules import CampaignMovement
from orchestrator.core.models import Schedule, ScheduleFire
from orchestrator.core.repositories import ScheduleRepository, utcnow
from orchestrator.schedules import intake
from orchestrator.schedules import service as schedule_service
from orchestrator.schedules.cron import NEXT_FIRES, next_fire_times, zone
from orchestrator.schedules.retune import campaign_movement, describe_movement
from orchestrator.schedules.service import sweep_regressions

router = APIRouter(prefix="/api/v1", tags=["schedules"])


def _movement(
    request: Request, session: Session, sched: Schedule, fire: ScheduleFire
) -> CampaignMovement | None:
    """Whether the fire's campaign moved the best configuration (:func:`campaign_movement`),
    its times in the schedule's zone."""
    moved = campaign_movement(session, fire)
    if moved is None:
        return None
    prev = moved["compared_with"]
    if prev is not None:
        prev = {**prev, "fire_time": prev["fire_time"].astimezone(zone(sched.timezone))}
    return CampaignMovement(
        **{**moved, "compared_with": prev},
        campaign_url=url_for_id(request, "get_campaign", campaign_id=moved["campaign_id"]),
        summary=describe_movement(moved),
    )


def _fire_brief(
    request: Request, session: Session, sched: Schedule, fire: ScheduleFire
) -> FireBrief:
    return FireBrief(
        fire_time=fire.fire_time.astimezone(zone(sched.timezone)),
        status=fire.status,
        experiment_id=fire.experiment_id,
        detail=fire.detail,
        campaign_id=fire.campaign_id,
        movement=_movement(request, session, sched, fire),
    )


def _schedule_out(request: Request, session: Session, sched: Schedule) -> ScheduleOut:
    now = utcnow()
    after = max(now, sched.last_fire_at) if sched.last_fire_at else now
    fires, _ = ScheduleRepository(session).fires(sched.id, limit=10, offset=0)
    recent = [_fire_brief(request, session, sched, f) for f in fires]
    return ScheduleOut(
        id=sched.id,
        url=str(request.url_for("get_schedule", schedule_id=sched.id)),
        fires_url=str(request.url_for("list_schedule_fires", schedule_id=sched.id)),
        name=sched.name,
        cron=sched.cron,
        timezone=sched.timezone,
        kind="campaign" if sched.campaign is not None else "sweep",
        template=sched.template,
        campaign=sched.campaign,
        enabled=sched.enabled,
        concurrency_policy=sched.concurrency_policy,
        catch_up=sched.catch_up,
        end_at=sched.end_at,
        created_at=sched.created_at,
        updated_at=sched.updated_at,
        created_by=sched.created_by,
        updated_by=sched.updated_by,
        last_fire_at=sched.last_fire_at,
        next_fire_times=(
            next_fire_times(sched.cron, sched.timezone, after, NEXT_FIRES, sched.end_at)
            if sched.enabled
            else []
        ),
        recent_fires=recent,
        last_movement=next((f.movement for f in recent if f.movement is not None), None),
    )


@router.post("/schedules", status_code=201, response_model=ScheduleOut)
def create_schedule(
    body: ScheduleIn,
    request: Request,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
) -> ScheduleOut:
    """Store a scheduled sweep: ``template`` is submitted as an experiment at each fire
    time; or a scheduled campaign: ``campaign`` (a campaign request) is started through
    the campaign intake at each fire time, and each fire says whether the best
    configuration moved since the previous campaign.

    422 problem+json: ``request_invalid`` for a bad field (an invalid ``cron``
    or ``timezone`` names the field and the value), ``schedule_invalid`` when
    the template fails experiment validation (locations under
    ``body.template``) or an ``end_at`` already past, ``campaign_invalid`` when the
    campaign request fails the campaign checks (locations under ``body.campaign``);
    409 ``schedule_name_taken``. Nothing is stored then.
    """
    values = body.model_dump()
    if body.campaign is not None:  # stored as submitted, as POST /campaigns reads it
        values["campaign"] = body.campaign.model_dump(mode="json", exclude_unset=True)
    sched = intake.create_schedule(session, settings, values)
    out = _schedule_out(request, session, sched)
    response.headers["Location"] = out.url
    return out


@router.get("/schedules", response_model=Page[ScheduleOut])
def list_schedules(
    request: Request, session: SessionDep, limit: Limit = 50, offset: Offset = 0
) -> Page[ScheduleOut]:
    """Schedules, newest first, each with its next fire times and latest fires."""
    rows, total = ScheduleRepository(session).page(limit=limit, offset=offset)
    items = [_schedule_out(request, session, s) for s in rows]
    return Page(items=items, total=total, limit=limit, offset=offset)


@router.get("/schedules/{schedule_id}", response_model=ScheduleOut)
def get_schedule(schedule_id: str, request: Request, session: SessionDep) -> ScheduleOut:
    """One schedule: its next 5 fire times (ISO 8601 in its zone) and its latest fires."""
    return _schedule_out(request, session, schedule_service.get_schedule(session, schedule_id))


@router.patch("/schedules/{schedule_id}", response_model=ScheduleOut)
def update_schedule(
    schedule_id: str,
    body: ScheduleUpdate,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
) -> ScheduleOut:
    """Change the given fields; the result is checked like a new schedule (422 / 409).

    Changing the timing or re-enabling restarts the fire times from now (time
    spent disabled is not caught up). A new template is checked by vLLM like a
    submission (503 ``submissions_busy`` when too many are being checked).
    """
    changes = body.model_dump(exclude_unset=True)
    if body.campaign is not None:
        changes["campaign"] = body.campaign.model_dump(mode="json", exclude_unset=True)
    sched = intake.update_schedule(session, settings, schedule_id, changes, ScheduleIn)
    return _schedule_out(request, session, sched)


@router.delete("/schedules/{schedule_id}", status_code=204)
def delete_schedule(schedule_id: str, session: SessionDep) -> Response:
    """Delete the schedule and its fire records; its experiments stay."""
    intake.delete_schedule(session, schedule_id)
    return Response(status_code=204)


@router.get("/schedules/{schedule_id}/fires", response_model=Page[FireOut])
def list_schedule_fires(
    schedule_id: str,
    request: Request,
    session: SessionDep,
    limit: Limit = 20,
    offset: Offset = 0,
) -> Page[FireOut]:
    """The schedule's fires, newest first, each with its regressions (a sweep's) or
    its campaign's movement (a campaign schedule's: moved or held).

    A fired sweep whose runs are all terminal is compared with the previous
    completed sweep of the schedule, variant by variant (same name): a metric
    whose 95 % bootstrap interval lies on the bad side and whose change passes the
    regression floor (5 %: :mod:`orchestrator.analysis.regression`) is a regression, a
    smaller worse change is listed in ``under_floor``
    (:func:`orchestrator.schedules.service.sweep_regressions`; computed on read).
    """
    sched = schedule_service.get_schedule(session, schedule_id)
    rows, total = ScheduleRepository(session).fires(sched.id, limit=limit, offset=offset)
    items = []
    for f in rows:
        reg = sweep_regressions(session, f)
        items.append(FireOut(**dict(_fire_brief(request, session, sched, f)), **reg))
    return Page(items=items, total=total, limit=limit, offset=offset)
