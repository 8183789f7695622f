"""Scheduled sweeps: cron schedules that submit an experiment template, and their fires.

A schedule may hold a campaign request instead of a template: each fire then starts a
tuning campaign (:mod:`orchestrator.schedules.retune`), once per fire time too.

Fire times come from :mod:`orchestrator.schedules.cron` (the schedule's ``cron`` in
its ``timezone``).

Firing (:func:`fire_due_schedules`, called from the dispatcher tick) is exactly
once per ``(schedule, fire_time)``: the ``schedule_fires`` row is inserted first
(``ON CONFLICT DO NOTHING`` on a UNIQUE constraint) and only the inserter
creates the experiment, in the same transaction.

Catch-up after downtime (fire times older than :data:`MISFIRE_GRACE_S`):
``latest`` fires the most recent missed time once and records each older one
as a ``skipped`` row (at most :data:`MAX_SKIPPED_RECORDED`, newest first; the
fired row's ``detail`` says how many); ``none`` records every missed time as
``skipped``. Policy ``skip`` records ``skipped_busy`` while the previous sweep
still has unfinished runs; ``queue`` fires anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.analysis.capacity_compare import (
    UNITS,
    CapacityComparison,
    CapacityRepeat,
    capacity_regression,
    compare_capacity,
)
from orchestrator.analysis.compare import compare_variant
from orchestrator.analysis.regression import is_regression
from orchestrator.analysis.service import capacity_repeats, runs_as_data
from orchestrator.core.db import unit_of_work
from orchestrator.core.errors import (
    ConflictError,
    NotFoundError,
    ScheduleInvalidError,
    SpecInvalidError,
    VlabError,
)
from orchestrator.core.models import Schedule, ScheduleFire
from orchestrator.core.repositories import ExperimentRepository, ScheduleRepository
from orchestrator.core.settings import Settings
from orchestrator.core.states import is_terminal
from orchestrator.core.telemetry import record_schedule_outcomes
from orchestrator.experiments.config_check import engine_resolver
from orchestrator.experiments.engine_catalog import EngineArgCatalog, load_catalog
from orchestrator.experiments.service import create_experiment, parse_spec, validate_spec
from orchestrator.experiments.spec import ExperimentSpec
from orchestrator.schedules import retune
from orchestrator.schedules.cron import fire_times, next_fire_at, zone

log = logging.getLogger(__name__)

#: a fire time at most this old (seconds) when handled is on time, not missed
MISFIRE_GRACE_S = 60.0
#: older missed fire times recorded one row each, at most
MAX_SKIPPED_RECORDED = 100


def validate_template(
    session: Session, settings: Settings, catalog: EngineArgCatalog, template: Any
) -> ExperimentSpec:
    """Check ``template`` as ``POST /api/v1/experiments`` would, storing nothing.

    Runs :func:`orchestrator.experiments.service.parse_spec` and
    :func:`orchestrator.experiments.service.validate_spec` (the design expansion, model
    resolution and the planning checks against the live cluster). Raises
    :class:`ScheduleInvalidError` with every problem (locations under
    ``["body", "template", ...]``).
    """
    try:
        spec = parse_spec(template, settings, catalog)
        validate_spec(session, settings, spec, catalog, resolver=engine_resolver(settings))
    except SpecInvalidError as exc:
        errors = []
        for e in exc.errors:
            loc = list(e.get("loc", []))
            rest = loc[1:] if loc[:1] == ["body"] else loc
            errors.append({**e, "loc": ["body", "template", *rest]})
        raise ScheduleInvalidError(errors) from exc
    return spec


def get_schedule(session: Session, schedule_id: str) -> Schedule:
    """The schedule; :class:`NotFoundError` (``schedule_not_found``) when missing."""
    sched = ScheduleRepository(session).get(schedule_id)
    if sched is None:
        raise NotFoundError(f"no schedule {schedule_id}", code_hint="schedule_not_found")
    return sched


def save_schedule(
    session: Session,
    settings: Settings,
    catalog: EngineArgCatalog | None,
    values: dict[str, Any],
    *,
    now: datetime,
    existing: Schedule | None = None,
) -> Schedule:
    """Create a schedule (``existing`` None) or overwrite ``existing`` with ``values``.

    ``values``: the fields of ``api.schemas.ScheduleIn`` (cron and time zone
    already checked). The template is validated (:func:`validate_template`:
    422 ``schedule_invalid``); a name another schedule has is 409
    ``schedule_name_taken``. ``next_fire_at`` is recomputed from ``now`` (or
    the last fire, if later) when the timing changes or the schedule is
    (re-)enabled, so time spent disabled is not caught up.
    """
    repo = ScheduleRepository(session)
    if values.get("template") is not None:
        cat = catalog if catalog is not None else load_catalog(settings)
        validate_template(session, settings, cat, values["template"])
    if "name" in values:
        other = repo.by_name(values["name"])
        if other is not None and other is not existing:
            raise ConflictError(
                f"a schedule named {values['name']!r} exists", code_hint="schedule_name_taken"
            )
    sched = existing or Schedule()
    retime = existing is None or any(
        k in values and values[k] != getattr(existing, k)
        for k in ("cron", "timezone", "end_at", "enabled")
    )
    for k, v in values.items():
        setattr(sched, k, v)
    # the database's clock, as created_at's default: a new schedule's two times are
    # equal, a later change is never before its creation (``now`` can be a check's
    # length behind the write, and another host's clock)
    sched.updated_at = func.now()  # type: ignore[assignment]
    if retime:
        after = max(now, sched.last_fire_at) if sched.last_fire_at else now
        sched.next_fire_at = next_fire_at(sched.cron, sched.timezone, after, sched.end_at)
    if existing is None:
        repo.add(sched)
    repo.reload(sched)
    return sched


@dataclass
class FireOutcome:
    """One fire row written by :func:`fire_due_schedules`."""

    schedule_id: str
    fire_time: datetime
    status: str
    experiment_id: str | None = None
    detail: str | None = None
    campaign_id: str | None = None


def fire_due_schedules(
    session_factory: sessionmaker[Session],
    settings: Settings,
    catalog: EngineArgCatalog | None = None,
    *,
    now: datetime,
) -> list[FireOutcome]:
    """Handle every enabled schedule whose next fire time is at or before ``now``.

    One transaction per schedule: its row is locked (``SKIP LOCKED``: another
    orchestrator handling it is left alone), the fire rows are inserted and, for
    the winner of the fire time to run, the experiment is created. ``catalog``
    is loaded (:func:`load_catalog`) only when an experiment is to be created.
    Returns the fire rows this call wrote (none for times another process took).
    """
    with unit_of_work(session_factory) as s:
        due = ScheduleRepository(s).due_ids(now)
    out: list[FireOutcome] = []
    cache: dict[str, EngineArgCatalog] = {}

    def get_catalog() -> EngineArgCatalog:
        if catalog is not None:
            return catalog
        if "c" not in cache:
            cache["c"] = load_catalog(settings)
        return cache["c"]

    for schedule_id in due:
        try:
            with unit_of_work(session_factory) as s:
                # a campaign schedule's campaign goes through the intake first (it commits
                # before asking vLLM), then is stored in the transaction of its fire row
                prepared = retune.prepare_campaign(s, settings, schedule_id, now)
                written = _fire_one(s, settings, get_catalog, schedule_id, now, prepared)
                retune.discard_unused(s, prepared, [o.campaign_id for o in written])
        except Exception:  # noqa: BLE001 - one bad schedule must not stop the others
            log.exception("schedule %s: firing failed", schedule_id)
            continue
        # counted once committed: vlab_schedule_fires_total / vlab_schedule_misses_total
        record_schedule_outcomes(o.status for o in written)
        out += written
    return out


def _fire_one(
    session: Session,
    settings: Settings,
    get_catalog: Callable[[], EngineArgCatalog],
    schedule_id: str,
    now: datetime,
    prepared: retune.Prepared = None,
) -> list[FireOutcome]:
    repo = ScheduleRepository(session)
    sched = repo.lock(schedule_id)
    if sched is None or not sched.enabled or sched.next_fire_at is None:
        return []
    start = sched.next_fire_at
    if start > now:
        return []
    tz = zone(sched.timezone)
    upto = min(now, sched.end_at) if sched.end_at is not None else now
    times: list[datetime] = []
    truncated = False
    for t in fire_times(sched.cron, tz, upto + timedelta(seconds=1), forward=False):
        if t > upto:
            continue
        if t < start:
            break
        if len(times) > MAX_SKIPPED_RECORDED:
            truncated = True
            break
        times.append(t)
    out: list[FireOutcome] = []
    if times:
        latest, older = times[0], times[1:]
        on_time = (now - latest).total_seconds() <= MISFIRE_GRACE_S
        for t in older:
            if repo.insert_fire(sched.id, t, "skipped", "missed; catch-up ran a later fire"):
                out.append(FireOutcome(sched.id, t, "skipped"))
        if sched.catch_up == "none" and not on_time:
            if repo.insert_fire(sched.id, latest, "skipped", "missed; catch_up is none"):
                out.append(FireOutcome(sched.id, latest, "skipped"))
        else:
            note = f"{len(older)}{'+' if truncated else ''} older missed fire(s) skipped"
            outcome = _fire(
                session, settings, get_catalog, sched, latest, note if older else None, prepared
            )
            if outcome is not None:
                out.append(outcome)
        sched.last_fire_at = latest
    sched.next_fire_at = next_fire_at(sched.cron, sched.timezone, upto, sched.end_at)
    return out


def _fire(
    session: Session,
    settings: Settings,
    get_catalog: Callable[[], EngineArgCatalog],
    sched: Schedule,
    fire_time: datetime,
    note: str | None,
    prepared: retune.Prepared = None,
) -> FireOutcome | None:
    repo = ScheduleRepository(session)
    detail = _busy(session, sched) if sched.concurrency_policy == "skip" else None
    if detail is not None:
        fire = repo.insert_fire(sched.id, fire_time, "skipped_busy", detail)
        return FireOutcome(sched.id, fire_time, "skipped_busy", detail=detail) if fire else None
    fire = repo.insert_fire(sched.id, fire_time, "fired", note)
    if fire is None:
        return None  # another orchestrator won this fire time
    if sched.campaign is not None:
        status, detail = retune.fire_campaign(session, sched, fire, prepared)
        log.info("schedule %s fired at %s: campaign %s", sched.id, fire_time, fire.campaign_id)
        return FireOutcome(sched.id, fire_time, status, None, detail, fire.campaign_id)
    try:
        with session.begin_nested():
            catalog = get_catalog()
            spec = parse_spec(sched.template, settings, catalog)
            exp = create_experiment(
                session, settings, spec, catalog, resolver=engine_resolver(settings)
            )
            exp.submitted_by = f"schedule:{sched.name}"[:200]
            for run in exp.runs:
                run.submitted_by = exp.submitted_by
            local = fire_time.astimezone(zone(sched.timezone)).isoformat()
            stamp = f"scheduled sweep {sched.name!r}, fire time {local}"
            exp.description = f"{exp.description}\n\n{stamp}" if exp.description else stamp
    except VlabError as exc:
        fire.status, fire.detail = "failed", f"{exc.code}: {exc.detail}"[:4000]
        log.warning("schedule %s: fire %s failed: %s", sched.id, fire_time, exc.detail)
        return FireOutcome(sched.id, fire_time, "failed", detail=fire.detail)
    fire.experiment_id = exp.id
    log.info("schedule %s fired at %s: experiment %s", sched.id, fire_time, exp.id)
    return FireOutcome(sched.id, fire_time, "fired", exp.id, note)


def _busy(session: Session, sched: Schedule) -> str | None:
    """Why a fire under policy ``skip`` is skipped (the previous sweep or campaign still
    runs), or None."""
    if sched.campaign is not None:
        busy = retune.busy_campaign(session, sched)
        return None if busy is None else f"previous campaign {busy} is still running"
    repo = ScheduleRepository(session)
    previous = repo.fired_before(sched.id, None, limit=1)
    if previous and previous[0].experiment_id and repo.has_active_runs(previous[0].experiment_id):
        return f"previous sweep {previous[0].experiment_id} still has unfinished runs"
    return None


def sweep_regressions(
    session: Session, fire: ScheduleFire, *, n_boot: int = 1000
) -> dict[str, Any]:
    """Regressions of a fired sweep against the previous completed sweep of its schedule.

    Shape: ``{"comparison": "not_fired" | "not_a_sweep" | "pending" | "no_previous" |
    "compared",
    "compared_with": {"fire_time", "experiment_id"} | None, "regressions":
    [{"variant", "metric", "unit", "reference_value", "value", "ratio", "ci_low",
    "ci_high", "ci_of", "statement"}], "under_floor": [the same shape], "withheld":
    [{"variant", "metric", "reason"}]}``.
    ``pending`` while the sweep has unfinished runs.
    For each variant name in both sweeps, the new runs (variant side) are
    compared with the previous sweep's runs of that name (reference side) by
    :func:`orchestrator.analysis.compare.compare_variant` (hierarchical bootstrap, 95 %);
    a metric whose verdict is ``worse`` by at least the regression floor
    (:data:`orchestrator.analysis.regression.MIN_CHANGE`, 5 %: the point ratio at or
    beyond ``1.05``, or ``1 / 1.05`` for a higher-is-better metric;
    :func:`orchestrator.analysis.regression.is_regression`) is a regression; a smaller
    worse change is not, and is listed in ``under_floor`` (the same shape), so nothing
    worse goes unsaid (``withheld`` is for untrusted metrics only). A metric a flag of
    either sweep's runs taints (token bursts, a warm prefix cache, a stalled client:
    :mod:`orchestrator.analysis.trust`) has no verdict and is listed in ``withheld``
    with the reason, never as a regression. Capacity under SLOs too:
    where both sweeps' runs of a variant stored capacity searches, the new
    capacity is compared with the previous one by
    :func:`orchestrator.analysis.capacity_compare.compare_capacity` and a ``lower`` verdict
    (the ratio's interval, or its upper bound when a sweep found only a bound, below 1)
    whose ratio (or that upper bound) is at or below ``1 / 1.05`` (the same floor;
    :func:`orchestrator.analysis.capacity_compare.capacity_regression`;
    ``reference_value``/``value`` None where a side has no mean capacity, ``statement``
    with the bounds) is a regression with
    ``metric`` ``"capacity"``, ``unit`` the search variable's (``requests/s`` or
    ``concurrent requests``) and ``ci_of`` ``"ratio"`` (a smaller ``lower``: in
    ``under_floor``). Computed on read.
    """
    empty: dict[str, Any] = {
        "compared_with": None,
        "regressions": [],
        "under_floor": [],
        "withheld": [],
    }
    if fire.campaign_id is not None:  # a campaign's fire: its movement says what changed
        return {"comparison": "not_a_sweep", **empty}
    if fire.status != "fired" or fire.experiment_id is None:
        return {"comparison": "not_fired", **empty}
    exps = ExperimentRepository(session)
    exp = exps.get(fire.experiment_id)
    if exp is None or any(not is_terminal(r.status) for r in exp.runs):
        return {"comparison": "pending", **empty}
    prev_exp = prev_fire = None
    for cand in ScheduleRepository(session).fired_before(fire.schedule_id, fire.fire_time):
        e = exps.get(cand.experiment_id) if cand.experiment_id else None
        if e is not None and all(is_terminal(r.status) for r in e.runs):
            prev_exp, prev_fire = e, cand
            break
    if prev_exp is None or prev_fire is None:
        return {"comparison": "no_previous", **empty}
    new, old = runs_as_data(session, list(exp.runs)), runs_as_data(session, list(prev_exp.runs))
    new_caps = capacity_repeats(list(exp.runs), new)
    old_caps = capacity_repeats(list(prev_exp.runs), old)
    lists: dict[str, list[dict[str, Any]]] = {"regressions": [], "under_floor": [], "withheld": []}
    for variant in [v["name"] for v in exp.variants if v["name"] in old]:
        metric_sides = (new.get(variant, []), old[variant])
        capacity_sides = (new_caps.get(variant, []), old_caps.get(variant, []))
        for key, rows in _regressions_of(variant, metric_sides, capacity_sides, n_boot).items():
            lists[key] += rows
    return {
        "comparison": "compared",
        "compared_with": {"fire_time": prev_fire.fire_time, "experiment_id": prev_exp.id},
        **lists,
    }


def _regressions_of(
    variant: str, metric_sides: tuple[Any, Any], capacity_sides: tuple[Any, Any], n_boot: int
) -> dict[str, list[dict[str, Any]]]:
    """One variant's ``regressions``, worse changes ``under_floor`` and ``withheld``
    metrics, new side against the previous sweep's: every metric
    (:func:`compare_variant`), then the capacity when both sides stored capacity searches."""
    out: dict[str, list[dict[str, Any]]] = {"regressions": [], "under_floor": [], "withheld": []}
    withheld = out["withheld"]
    for c in compare_variant(*metric_sides, n_boot=n_boot, seed=0):
        if not c.trustworthy:
            withheld.append({"variant": variant, "metric": c.metric, "reason": c.untrusted_reason})
        elif c.verdict == "worse":
            key = "regressions" if is_regression(c.direction, c.verdict, c.ratio) else "under_floor"
            out[key].append(
                {
                    "variant": variant,
                    "metric": c.metric,
                    "unit": c.unit,
                    "reference_value": c.reference,
                    "value": c.variant,
                    "ratio": c.ratio,
                    "ci_low": c.ci_low,
                    "ci_high": c.ci_high,
                    "ci_of": c.ci_of,
                    "statement": None,
                }
            )
    if not (_searched(capacity_sides[0]) and _searched(capacity_sides[1])):
        return out
    cap = compare_capacity(*capacity_sides)
    if not cap.trustworthy:
        withheld.append({"variant": variant, "metric": "capacity", "reason": cap.untrusted_reason})
    elif cap.verdict == "lower":
        out["regressions" if capacity_regression(cap) else "under_floor"].append(
            {
                "variant": variant,
                "metric": "capacity",
                "unit": UNITS.get(cap.variable or "", "load"),
                "reference_value": cap.reference_capacity,
                "value": cap.capacity,
                "ratio": cap.ratio,
                "ci_low": cap.ci_low,
                "ci_high": cap.ci_high,
                "ci_of": "ratio",
                "statement": _capacity_statement(cap),
            }
        )
    return out


def _capacity_statement(cap: CapacityComparison) -> str:
    """``lower: at most 0.25x (at least 24 -> below 6 requests/s)``: the verdict with the
    bounds each sweep showed."""
    return (
        f"{cap.statement} ({cap.bounds.get('reference')} -> {cap.bounds.get('variant')} {cap.unit})"
    )


def _searched(repeats: list[CapacityRepeat]) -> bool:
    """Whether a succeeded repeat stored a capacity search."""
    return any(r.status == "succeeded" and r.capacity is not None for r in repeats)
