"""Dashboard pages ``/schedules`` and ``/schedules/{id}``: scheduled sweeps and their fires.

``/schedules`` lists every schedule (newest first, 50 a page, ``?page=N``) with
its settings, the next 3 fire times (in the schedule's time zone and in UTC)
and the outcome of its latest fire: the sweep's experiment, its status and how
many regressions were flagged against the previous completed sweep.

A campaign schedule (one holding a campaign request) shows, for each fire, its campaign
and whether the best configuration moved since the previous campaign (what changed,
from -> to) or held.

``/schedules/{id}`` shows one schedule: settings, the experiment template, the
next 10 fire times and the fire history (20 a page, ``?page=N``), each fired
sweep with its regressions (metric, variant, previous and new value, ratio and
95 % interval).

Everything is computed with the functions the JSON API uses
(:func:`orchestrator.schedules.cron.next_fire_times` from the same ``after`` as
``GET /api/v1/schedules``, :func:`orchestrator.schedules.service.sweep_regressions` as
``GET /api/v1/schedules/{id}/fires``). The enable/disable button (``schedules.js``)
sends ``PATCH /api/v1/schedules/{id}`` and swaps in the re-rendered parts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from sqlalchemy.orm import Session

from api.deps import SessionDep
from orchestrator.analysis.compare import METRICS_BY_NAME
from orchestrator.analysis.regression import MIN_CHANGE, percent
from orchestrator.core.models import Schedule, ScheduleFire
from orchestrator.core.repositories import (
    ExperimentRepository,
    RunRepository,
    ScheduleRepository,
    utcnow,
)
from orchestrator.experiments.status import experiment_status
from orchestrator.schedules.cron import next_fire_times, zone
from orchestrator.schedules.retune import campaign_movement, describe_movement
from orchestrator.schedules.service import sweep_regressions
from web.pages.experiment import metric_label
from web.render import PageCache, not_found, render

router = APIRouter()

#: schedules per page of ``/schedules``
LIST_PER_PAGE = 50
#: fires per page of ``/schedules/{id}``
FIRES_PER_PAGE = 20
#: next fire times shown in the list and on the detail page
LIST_NEXT_FIRES = 3
DETAIL_NEXT_FIRES = 10
#: regression results kept (:func:`regressions`)
_CACHE_SIZE = 512
_cache = PageCache(_CACHE_SIZE)

#: ``POST /api/v1/schedules`` example shown when there is no schedule yet
EXAMPLE = {
    "name": "nightly apc regression",
    "cron": "0 2 * * *",
    "timezone": "Europe/Berlin",
    "concurrency_policy": "skip",
    "catch_up": "latest",
    "template": {
        "name": "nightly apc",
        "model": "tiny",
        "baseline": {
            "engine_args": {"enable_prefix_caching": False, "max_model_len": 1024},
            "workload": {"num_requests": 64, "prefix_tokens": 512, "seed": 1},
        },
        "variants": [{"name": "apc-on", "changes": {"engine_args.enable_prefix_caching": True}}],
        "repeats": 3,
    },
}


@dataclass(frozen=True)
class FireTime:
    """A fire time shown twice: wall clock in the schedule's zone and UTC.

    ``local``: ``2026-12-01 09:30 EST``; ``utc``: ``2026-12-01 14:30 UTC``;
    ``iso``: ISO 8601 with the zone's offset (``2026-12-01T09:30:00-05:00``).
    """

    local: str
    utc: str
    iso: str


def fire_time(t: datetime, tz_name: str) -> FireTime:
    """``t`` (offset-aware) as a :class:`FireTime` in zone ``tz_name``."""
    local = t.astimezone(zone(tz_name))
    return FireTime(
        local=local.strftime("%Y-%m-%d %H:%M ") + (local.tzname() or tz_name),
        utc=t.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        iso=local.isoformat(),
    )


def upcoming(sched: Schedule, count: int, now: datetime | None = None) -> list[FireTime]:
    """The next ``count`` fire times of an enabled schedule (none when disabled or ended).

    Same start as the API's ``next_fire_times``: after ``now`` or the last fire
    time handled, whichever is later; times after ``end_at`` are left out.
    """
    if not sched.enabled:
        return []
    now = now or utcnow()
    after = max(now, sched.last_fire_at) if sched.last_fire_at else now
    times = next_fire_times(sched.cron, sched.timezone, after, count, sched.end_at)
    return [fire_time(t, sched.timezone) for t in times]


def _regression_row(reg: dict[str, Any]) -> dict[str, Any]:
    """A regression (``sweep_regressions`` shape) with its heading (``TTFT p50 (ms)``)
    and values in display units (fractions as %)."""
    spec = METRICS_BY_NAME.get(reg["metric"])
    scale = 100.0 if reg["unit"] == "fraction" else 1.0
    return {
        **reg,
        "label": metric_label(spec) if spec else reg["metric"],
        "display_unit": "%" if reg["unit"] == "fraction" else reg["unit"],
        # None where a sweep showed only a bound for its capacity (see ``statement``)
        "reference_shown": _scaled(reg.get("reference_value"), scale),
        "value_shown": _scaled(reg.get("value"), scale),
        # a CI of the difference is in the metric's unit; of the ratio, unitless
        "ci_scale": scale if reg["ci_of"] == "difference" else 1.0,
    }


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def _regressions_key(session: Session, fire: ScheduleFire) -> tuple[Any, ...]:
    """What :func:`sweep_regressions` of ``fire`` depends on: the fire, and the ids and
    statuses of the runs of its sweep and of the earlier sweeps it may be compared with
    (a terminal run, and so its measurements, never changes)."""
    if fire.status != "fired" or fire.experiment_id is None:
        return (fire.id, fire.status, fire.experiment_id)
    earlier = ScheduleRepository(session).fired_before(fire.schedule_id, fire.fire_time)
    exp_ids = [fire.experiment_id, *(f.experiment_id for f in earlier if f.experiment_id)]
    runs = RunRepository(session).statuses_of_experiments(exp_ids)
    return (fire.id, fire.status, tuple(exp_ids), tuple(runs))


def regressions(session: Session, fire: ScheduleFire) -> dict[str, Any]:
    """:func:`orchestrator.schedules.service.sweep_regressions` of ``fire`` (same shape), cached
    while the runs it depends on (:func:`_regressions_key`) keep their statuses: the
    bootstrap takes about 0.3 s per compared sweep and the list shows up to 50."""
    key = _regressions_key(session, fire)
    hit: dict[str, Any] | None = _cache.get(key)
    if hit is not None:
        return hit
    result = sweep_regressions(session, fire)
    _cache.put(key, result)
    return result


def movement_view(session: Session, sched: Schedule, fire: ScheduleFire) -> dict[str, Any] | None:
    """A campaign fire's movement (:func:`orchestrator.schedules.retune.campaign_movement`,
    as ``GET /api/v1/schedules/{id}/fires`` shows it) with its one-line summary and the
    previous campaign's fire time; None for a sweep's fire."""
    moved = campaign_movement(session, fire)
    if moved is None:
        return None
    prev = moved["compared_with"]
    if prev is not None:
        prev = {**prev, "time": fire_time(prev["fire_time"], sched.timezone)}
    return {**moved, "compared_with": prev, "summary": describe_movement(moved)}


def fire_view(session: Session, sched: Schedule, fire: ScheduleFire) -> dict[str, Any]:
    """One fire for the templates: time, status, detail, its experiment (id, name,
    aggregate status) and its regressions (:func:`regressions`) with display labels, or
    its campaign and whether it moved the best configuration (:func:`movement_view`)."""
    exp = ExperimentRepository(session).get(fire.experiment_id) if fire.experiment_id else None
    check = regressions(session, fire)
    compared_with = check["compared_with"]
    if compared_with is not None:
        compared_with = {
            **compared_with,
            "time": fire_time(compared_with["fire_time"], sched.timezone),
        }
    return {
        "id": fire.id,
        "time": fire_time(fire.fire_time, sched.timezone),
        "status": fire.status,
        "detail": fire.detail,
        "experiment_id": fire.experiment_id,
        "experiment_name": exp.name if exp else None,
        "experiment_status": experiment_status(list(exp.runs)) if exp else None,
        "campaign_id": fire.campaign_id,
        "movement": movement_view(session, sched, fire),
        "comparison": check["comparison"],
        "compared_with": compared_with,
        "regressions": [_regression_row(r) for r in check["regressions"]],
        # worse, but by less than the regression floor: said, never a regression
        "under_floor": [_regression_row(r) for r in check.get("under_floor", [])],
        "floor": percent(MIN_CHANGE),
        # metrics a flag of a compared run taints: no verdict, never a regression
        "withheld": [
            {**w, "label": metric_label(METRICS_BY_NAME[w["metric"]])}
            if w["metric"] in METRICS_BY_NAME
            else {**w, "label": w["metric"]}
            for w in check.get("withheld", [])
        ],
    }


def schedule_view(
    session: Session, sched: Schedule, next_count: int, *, with_latest: bool = True
) -> dict[str, Any]:
    """A schedule for the templates: the row itself, its upcoming fire times
    and (``with_latest``) its latest fire (:func:`fire_view`) or None."""
    latest, total = ScheduleRepository(session).fires(
        sched.id, limit=1 if with_latest else 0, offset=0
    )
    return {
        "s": sched,
        "next": upcoming(sched, next_count),
        "last_fire": fire_time(sched.last_fire_at, sched.timezone) if sched.last_fire_at else None,
        "end": fire_time(sched.end_at, sched.timezone) if sched.end_at else None,
        "latest": fire_view(session, sched, latest[0]) if latest else None,
        "fire_count": total,
    }


def _page_number(raw: str | None) -> int:
    try:
        return max(1, int(raw or "1"))
    except ValueError:
        return 1


@router.get("/schedules", response_class=HTMLResponse)
def schedules(request: Request, session: SessionDep) -> HTMLResponse:
    """The schedule list, newest first, 50 a page (``?page=N``, 1-based)."""
    page = _page_number(request.query_params.get("page"))
    rows, total = ScheduleRepository(session).page(
        limit=LIST_PER_PAGE, offset=(page - 1) * LIST_PER_PAGE
    )
    context = {
        "nav": "schedules",
        "items": [schedule_view(session, s, LIST_NEXT_FIRES) for s in rows],
        "total": total,
        "page": page,
        "pages": max(1, -(-total // LIST_PER_PAGE)),
        "next_count": LIST_NEXT_FIRES,
        "example": json.dumps(EXAMPLE, indent=2),
    }
    return render(request, "schedules.html", context)


@router.get("/schedules/{schedule_id}", response_class=HTMLResponse)
def schedule(schedule_id: str, request: Request, session: SessionDep) -> HTMLResponse:
    """One schedule and its fires, newest first, 20 a page (``?page=N``); 404 page
    when there is no such schedule."""
    page = _page_number(request.query_params.get("page"))
    sched = ScheduleRepository(session).get(schedule_id)
    if sched is None:
        return not_found(request, f"No schedule {schedule_id}.")
    fires, total = ScheduleRepository(session).fires(
        sched.id, limit=FIRES_PER_PAGE, offset=(page - 1) * FIRES_PER_PAGE
    )
    context = {
        "nav": "schedules",
        "item": schedule_view(session, sched, DETAIL_NEXT_FIRES, with_latest=False),
        "template_json": json.dumps(
            sched.campaign if sched.campaign is not None else sched.template, indent=2
        ),
        "fires": [fire_view(session, sched, f) for f in fires],
        "fire_total": total,
        "page": page,
        "pages": max(1, -(-total // FIRES_PER_PAGE)),
        "next_count": DETAIL_NEXT_FIRES,
        "live_ms": _live_ms(request),
    }
    return render(request, "schedule.html", context)


def _live_ms(request: Request) -> int:
    """How often the page re-renders its live parts (``?live_ms=``, 1-60 s; default 20 s)."""
    try:
        return min(60_000, max(1_000, int(request.query_params.get("live_ms") or 20_000)))
    except ValueError:
        return 20_000
