"""Schedules as the API creates, changes and deletes them: one call per request.

A campaign schedule's request is checked as ``POST /api/v1/campaigns`` checks one
(:func:`orchestrator.schedules.retune.check_campaign`: 422 ``campaign_invalid``, the
problems under ``body.campaign``).

A new schedule whose ``end_at`` is past, or whose cron never fires before it, is
refused (422 ``schedule_invalid``). A template is asked of vLLM with no database
connection held, inside a check slot (503 ``submissions_busy`` when too many are
being checked), and the validation when saving reuses those answers
(:func:`orchestrator.experiments.config_check.remembered_checks`). The caller's unit of
work commits.
"""

from __future__ import annotations

import contextlib
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ValidationError
from sqlalchemy.orm import Session

from orchestrator.core.db import release_connection
from orchestrator.core.errors import ScheduleInvalidError
from orchestrator.core.models import Schedule
from orchestrator.core.repositories import ScheduleRepository, utcnow
from orchestrator.core.settings import Settings
from orchestrator.experiments.config_check import gate_for, remembered_checks
from orchestrator.experiments.engine_catalog import load_catalog
from orchestrator.experiments.service import precheck
from orchestrator.schedules.cron import next_fire_times
from orchestrator.schedules.retune import check_campaign
from orchestrator.schedules.service import get_schedule, save_schedule

#: Fields stored as the JSON documents given.
_DOCUMENTS = ("template", "campaign")


def check_end_at(cron: str, timezone: str, end_at: datetime | None, now: datetime) -> None:
    """422 ``schedule_invalid`` when ``end_at`` is not after ``now`` or ``cron`` (in
    ``timezone``) never fires before it: the schedule would never fire."""
    if end_at is None:
        return
    if end_at <= now:
        raise ScheduleInvalidError(
            [
                {
                    "loc": ["body", "end_at"],
                    "msg": f"end_at {end_at.isoformat()} is in the past: the schedule "
                    "would never fire",
                    "type": "end_at_past",
                }
            ]
        )
    if not next_fire_times(cron, timezone, now, 1, end_at):
        raise ScheduleInvalidError(
            [
                {
                    "loc": ["body", "cron"],
                    "msg": f"cron {cron!r} never fires before end_at {end_at.isoformat()}",
                    "type": "never_fires",
                }
            ]
        )


def create_schedule(session: Session, settings: Settings, values: dict[str, Any]) -> Schedule:
    """Store a new schedule from ``values`` (the API's ``ScheduleIn`` fields, cron and
    time zone checked): 422 ``schedule_invalid`` (``end_at``, the template), 409
    ``schedule_name_taken``; nothing stored then."""
    now = utcnow()
    check_end_at(values["cron"], values.get("timezone", "UTC"), values.get("end_at"), now)
    if values.get("campaign") is not None:  # a scheduled campaign: checked by its intake
        check_campaign(session, settings, values["campaign"])
        return save_schedule(session, settings, None, values, now=utcnow())
    release_connection(session)
    with gate_for(settings).slot(), remembered_checks():
        catalog = load_catalog(settings)
        # vLLM's check with no connection held; the validation below reuses its answers
        precheck(settings, catalog, values["template"])
        # the next fire from the time of the write, not from before the check
        return save_schedule(session, settings, catalog, values, now=utcnow())


def update_schedule(
    session: Session,
    settings: Settings,
    schedule_id: str,
    changes: dict[str, Any],
    schema: type[BaseModel],
) -> Schedule:
    """Change the fields in ``changes``; the whole result is checked with ``schema``
    (the model a new schedule is checked with, the API's ``ScheduleIn``) and then like
    a new schedule (422 / 409). A new template is checked by vLLM like a submission, a
    new campaign request like a campaign submission; giving one replaces the other."""
    if changes.get("campaign") is not None:
        changes = {**changes, "template": None}
        check_campaign(session, settings, changes["campaign"])
    elif changes.get("template") is not None:
        changes = {**changes, "campaign": None}
    with contextlib.ExitStack() as checking:
        if changes.get("template") is not None:
            release_connection(session)
            checking.enter_context(gate_for(settings).slot())
            checking.enter_context(remembered_checks())
            precheck(settings, load_catalog(settings), changes["template"])
        sched = get_schedule(session, schedule_id)
        current = {k: getattr(sched, k) for k in schema.model_fields}
        try:
            merged = schema.model_validate({**current, **changes})
        except ValidationError as exc:
            raise ScheduleInvalidError.from_validation(exc) from exc
        # the documents as given (a campaign request stored as submitted, not its model)
        values = {k: changes[k] if k in _DOCUMENTS else getattr(merged, k) for k in changes}
        return save_schedule(
            session,
            settings,
            load_catalog(settings) if "template" in values else None,
            values,
            now=utcnow(),
            existing=sched,
        )


def delete_schedule(session: Session, schedule_id: str) -> None:
    """Delete the schedule and its fire records; its experiments stay."""
    ScheduleRepository(session).delete(get_schedule(session, schedule_id))
