"""A tuning campaign as a stored, running thing: advance it, read its result, cancel it.

The decisions are the pure core's (:class:`orchestrator.campaigns.loop.Campaign`), rebuilt
on every :func:`advance` from the campaign's runs: each run carries its campaign and label
(``runs.campaign_id``, ``runs.campaign_label``); a succeeded run is recorded with its
objective (the stored summary metric the request names), a run that ended otherwise
(failed, cancelled, blocked, or succeeded without the metric) as failed, and one the
infrastructure lost (:func:`orchestrator.tuning.run_loss.lost_to_infrastructure`) as lost:
the core plans it again under a retry label, queued as its own experiment (with the
incumbent's retry when that was lost too, so that candidates stay one-variable
variants of it). A succeeded run whose objective a finding flags
(:mod:`orchestrator.analysis.trust`: a warm prefix cache, token bursts for TPOT/ITL, the
client's TTFT lag) gives no verdict: it is recorded lost with that reason and measured
again the same way, as is a succeeded run without the GPU energy reading a J/token
objective needs, or without a capacity (its search found no boundary). A per-device
objective is the stored throughput over the devices the run reserved. The result says why
each run measured again was (``retry_reasons``: lost, flagged, or no value). The core then
says which runs come next; those not stored yet are queued as **one experiment per
cycle** (:mod:`orchestrator.tuning.cycles`), through the same checks as a submitted
experiment (:func:`orchestrator.experiments.service.create_experiment`), several pairs at
once when the cluster holds the cycle side by side (:mod:`orchestrator.tuning.measuring_slots`,
fixed at the first advance). A cycle's runs are stored in one
transaction, and ``(campaign_id, campaign_label)`` is unique: advancing again, or after a
restart, queues nothing twice.

When the core says done, the result (path, candidates, confirmation) is written and the
campaign ends ``succeeded``; a cycle the experiment checks refuse (422) ends it
``failed`` with their problems, while a check that cannot be done now (503: the engine
environment, the submission gate) is raised and tried again on the next advance.
Services take a session and never commit.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy.orm import Session, sessionmaker

from orchestrator.analysis.trust import TRUST_METRICS, not_applicable_of, run_trust
from orchestrator.campaigns.loop import Campaign as CoreCampaign
from orchestrator.campaigns.outcomes import OrderHook, Outcome, Phase, PlannedRun
from orchestrator.campaigns.space import show_level
from orchestrator.core.db import is_unavailable, unit_of_work
from orchestrator.core.errors import ConflictError, InvalidInputError, NotFoundError
from orchestrator.core.models import Campaign, Run
from orchestrator.core.repositories import CampaignRepository, RunRepository
from orchestrator.core.repositories.campaigns import ENDED
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus, is_terminal
from orchestrator.experiments.config_check import engine_resolver, remembered_checks
from orchestrator.experiments.engine_catalog import EngineArgCatalog, load_catalog
from orchestrator.experiments.service import create_experiment, parse_spec, precheck
from orchestrator.experiments.spec import Layout
from orchestrator.tuning.campaign_request import (
    CAPACITY_OBJECTIVES,
    GPU_TELEMETRY,
    PER_DEVICE,
    CampaignRequest,
    stored_metric,
)
from orchestrator.tuning.cycles import cycle_doc, experiments_of, label_runs
from orchestrator.tuning.evidence import Evidence
from orchestrator.tuning.evidence_inputs import RoundOrders, gather_evidence
from orchestrator.tuning.final_config import final_result
from orchestrator.tuning.measuring_slots import campaign_slots
from orchestrator.tuning.run_loss import loss_of
from orchestrator.tuning.wall_time import wall_time

log = logging.getLogger(__name__)


def get_campaign(session: Session, campaign_id: str) -> Campaign:
    """The campaign; :class:`NotFoundError` (``campaign_not_found``) when missing."""
    row = CampaignRepository(session).get(campaign_id)
    if row is None:
        raise NotFoundError(f"no campaign {campaign_id}", code_hint="campaign_not_found")
    return row


def rebuild(
    request: CampaignRequest,
    runs: list[Run],
    metrics: dict[str, dict[str, float]],
    order: OrderHook | None = None,
    began: datetime | None = None,
    slots: int = 1,
) -> tuple[CoreCampaign, dict[str | None, Run]]:
    """The core campaign replayed from ``runs`` (the campaign's stored runs) and their
    ``metrics`` (run id -> summary metrics), each round's candidates ordered by ``order``
    (:func:`order_hook`): returns ``(core, by_label)``. ``began``: when the campaign was
    submitted (its wall-time budget counts from it; each run's end is read from its
    ``finished_at``, so a replay decides as the first pass did).

    Replays cycle by cycle: every run the core has planned whose stored run ended is
    recorded (its objective, or ``None``: failed, or lost to the infrastructure) until the
    core waits on a run that has not ended or was not stored yet.
    """
    core = CoreCampaign(
        request.core_space(),
        request.start(),
        request.rule,
        request.budget.max_runs,
        direction=request.objective.resolved_direction,
        order=order,
        constraints=[c.core() for c in request.constraints],
        max_device_s=_seconds(request.budget.max_device_hours),
        max_wall_s=_seconds(request.budget.max_wall_hours),
        slots=slots,
    )
    by_label: dict[str | None, Run] = {r.campaign_label: r for r in runs if r.campaign_label}
    progressed = True
    while progressed and core.phase is not Phase.DONE:
        progressed = False
        for planned in core.next_runs():
            run = by_label.get(planned.label)
            if run is None or not is_terminal(run.status):
                continue
            value = _objective(run, metrics, request.objective.metric)
            no_verdict = _no_verdict(run, metrics, request.objective.metric, value)
            device_s, ended_s = _device_s(run), _ended_s(run, began)
            if no_verdict is not None and no_verdict.kind != "lost":  # measured again, as lost
                why, again = no_verdict.core_why, no_verdict.again
                core.record(planned.label, None, True, why, None, device_s, ended_s, again)
            else:
                lost = no_verdict is not None
                checks = _checks(run, metrics, request) if value is not None else None
                core.record(planned.label, value, lost, None, checks, device_s, ended_s)
            progressed = True
    return core, by_label


def order_hook(
    session: Session,
    settings: Settings | None,
    row: Campaign,
    request: CampaignRequest,
    runs: list[Run],
) -> tuple[RoundOrders, OrderHook | None]:
    """The hook that orders each round's candidates by evidence
    (:mod:`orchestrator.tuning.evidence`): a round already opened answers as it was kept in
    ``result["order"]``, a new one from the evidence gathered now (once, when first needed;
    the space's order when it cannot be gathered). A campaign that queued runs before
    rounds were kept has no hook (its rounds were opened in the space's order)."""
    result = row.result or {}
    orders = RoundOrders(result.get("order"))
    if runs and "order" not in result:
        return orders, None

    def evidence() -> Evidence:
        if settings is None:
            return Evidence(baseline=request.baseline)
        try:
            return gather_evidence(session, settings, request, runs)
        except Exception as exc:
            if is_unavailable(exc):
                raise
            log.warning("campaign %s: no evidence to order its candidates: %s", row.id, exc)
            return Evidence(baseline=request.baseline)

    return orders, orders.hook(evidence)


def _keep_orders(row: Campaign, orders: RoundOrders) -> None:
    row.result = {**(row.result or {}), "order": orders.kept}


def _metric_names(request: CampaignRequest) -> list[str]:
    """The stored run metrics a campaign decides from: its objective's, its constraints'
    and what the findings that may flag them read."""
    named = [request.objective.metric, *(c.metric for c in request.constraints)]
    return [*(stored_metric(m) for m in named), *TRUST_METRICS]


def _seconds(hours: float | None) -> float | None:
    return None if hours is None else hours * 3600.0


def _ended_s(run: Run, began: datetime | None) -> float | None:
    """When ``run`` ended, in seconds after the campaign began (None when unknown)."""
    if began is None or run.finished_at is None:
        return None
    return max((run.finished_at - began).total_seconds(), 0.0)


def _device_s(run: Run) -> float:
    """Device-seconds ``run`` held: its reserved devices x its time from claim to end."""
    if run.claimed_at is None or run.finished_at is None:
        return 0.0
    held = max((run.finished_at - run.claimed_at).total_seconds(), 0.0)
    return held * Layout.model_validate(run.layout or {}).reserved


def _checks(
    run: Run, metrics: dict[str, dict[str, float]], request: CampaignRequest
) -> dict[str, float | None]:
    """The run's value of each constraint's metric; None where it has none, or a finding
    flags it (no verdict from it: :func:`_flagged`)."""
    out: dict[str, float | None] = {}
    for c in request.constraints:
        value = _objective(run, metrics, c.metric)
        out[c.metric] = None if value is None or _flagged(run, metrics, c.metric) else value
    return out


@dataclass(frozen=True)
class _NoVerdict:
    """Why an ended run gives its configuration no verdict: ``kind`` ``lost`` (the
    infrastructure lost it: ``detail`` says how), ``flagged`` (a finding flags its objective:
    ``detail`` names each finding and its evidence) or ``no_value`` (it succeeded without a
    value of its objective); ``again``: whether measuring it again may change that."""

    kind: Literal["lost", "flagged", "no_value"]
    detail: str
    again: bool = True

    @property
    def core_why(self) -> str | None:
        """What the core says happened to the run (None: "lost to the infrastructure")."""
        return {"lost": None, "flagged": f"flagged by a finding ({self.detail})"}.get(
            self.kind, self.detail
        )

    def retry_reason(self) -> dict[str, str]:
        """The campaign result's ``retry_reasons`` entry: ``kind`` and ``why`` in words."""
        why = {
            "lost": f"lost to the infrastructure: {self.detail}",
            "flagged": f"a finding flagged its objective: {self.detail}",
        }.get(self.kind, self.detail)
        return {"kind": self.kind, "why": why}


def _no_verdict(
    run: Run, metrics: dict[str, dict[str, float]], metric: str, value: float | None
) -> _NoVerdict | None:
    """Why ended ``run`` (its objective ``metric`` read as ``value``) gives no verdict and
    is recorded lost (:func:`rebuild`), None when it gives one (a value, or a failure)."""
    if value is None:
        unread = _unread(run, metric)
        if unread is not None:
            return _NoVerdict("no_value", *unread)
        loss = loss_of(run)
        return None if loss is None else _NoVerdict("lost", loss)
    flagged = _flagged(run, metrics, metric)
    return None if flagged is None else _NoVerdict("flagged", flagged)


def _retry_reasons(
    core: CoreCampaign,
    by_label: dict[str | None, Run],
    metrics: dict[str, dict[str, float]],
    metric: str,
) -> dict[str, dict[str, str]]:
    """Why each run measured again was (``retried``'s labels): :meth:`_NoVerdict.retry_reason`."""
    out: dict[str, dict[str, str]] = {}
    for label in core.retries():
        run = by_label.get(label)
        if run is None:
            continue
        found = _no_verdict(run, metrics, metric, _objective(run, metrics, metric))
        if found is not None:
            out[label] = found.retry_reason()
    return out


def _flagged(run: Run, metrics: dict[str, dict[str, float]], metric: str) -> str | None:
    """Why a finding withholds ``run``'s ``metric`` from any verdict
    (:mod:`orchestrator.analysis.trust`: token bursts, the client's TTFT lag, a warm prefix
    cache, a load generator that stalled), each finding by name and its evidence
    (``client_ttft_lag: ...; ...``); None when nothing flags it."""
    warm = (run.engine_info or {}).get("cache_contamination") or {}
    trust = run_trust(
        run.id,
        metrics.get(run.id, {}),
        cache_contamination=warm.get("status") if isinstance(warm, dict) else None,
        not_applicable=not_applicable_of(run.engine_args),
    )
    taints = trust.taints(stored_metric(metric))
    return "; ".join(f"{flag}: {text}" for flag, text in taints.items()) or None


def _objective(run: Run, metrics: dict[str, dict[str, float]], metric: str) -> float | None:
    """``run``'s value of objective or constraint ``metric``: its stored metric, over the
    devices it reserved for a per-device one; None unless it succeeded with a positive
    finite value."""
    if run.status != RunStatus.SUCCEEDED.value:
        return None
    value = metrics.get(run.id, {}).get(stored_metric(metric))
    if value is None or not math.isfinite(value) or value <= 0:
        return None
    if metric in PER_DEVICE:
        return float(value) / max(Layout.model_validate(run.layout or {}).reserved, 1)
    return float(value)


def _unread(run: Run, metric: str) -> tuple[str, bool] | None:
    """Why a succeeded run without a value of objective ``metric`` says nothing of its
    configuration (``unknown``, never ``failed``), and whether measuring it again may
    change that: not for a run without GPU telemetry (J/token; yes when its telemetry read
    the GPUs but too few samples fell in its window) or a capacity search whose
    boundary lies outside its range; yes for a client-limited, uncertain or cut-short
    search. None otherwise."""
    if run.status != RunStatus.SUCCEEDED.value:
        return None
    if metric in GPU_TELEMETRY:
        telemetry = (run.engine_info or {}).get("gpu_telemetry") or {}
        if isinstance(telemetry, dict) and telemetry.get("available") is True:
            # it read the GPUs, but too few samples fell in the measured window (a read
            # past its timeout on a loaded node): another run may well get them
            notes = "; ".join(str(n) for n in telemetry.get("notes") or []) or "no reason given"
            return (
                f"measured without {metric} (its GPU telemetry sampled too little: {notes})",
                True,
            )
        return f"measured without {metric} (its GPU telemetry read no energy counter)", False
    if metric in CAPACITY_OBJECTIVES:
        search = run.capacity or {}
        status, why = search.get("status"), search.get("note") or "no boundary in its range"
        again = status not in ("below_min", "at_least_max")
        return f"measured without a capacity: the search ended {status} ({why})", again
    return None


def advance(
    session: Session,
    settings: Settings,
    campaign_id: str,
    *,
    catalog: Callable[[], EngineArgCatalog] | None = None,
) -> Campaign | None:
    """One step of campaign ``campaign_id``: rebuild it from its runs, queue the runs it
    plans next that are not stored yet, write its result; end it when the core is done.

    Locks the campaign's row (``SKIP LOCKED``: None when another transaction advances it
    now). A campaign that ended is returned unchanged. ``catalog`` loads vLLM's argument
    catalogue, only when runs are to be queued (default :func:`load_catalog`).
    """
    repo = CampaignRepository(session)
    row = repo.get(campaign_id, for_update=True, skip_locked=True)
    if row is None or row.status in ENDED:
        return row
    runs = repo.runs(row.id)
    try:
        request = CampaignRequest.model_validate(row.request)
        metrics = RunRepository(session).metrics_for([r.id for r in runs], _metric_names(request))
        orders, hook = order_hook(session, settings, row, request, runs)
        slots = campaign_slots(session, settings, row, request, started=bool(runs))
        core, by_label = rebuild(request, runs, metrics, hook, row.created_at, slots)
    except ValueError as exc:  # a stored request or run the core cannot replay
        row.status, row.status_reason = "failed", f"campaign_broken: {exc}"[:4000]
        log.warning("campaign %s: cannot be replayed: %s", row.id, exc)
        repo.touch(row)
        return row
    if core.phase is Phase.DONE:
        _write_result(row, request, core, by_label, metrics)
        _keep_orders(row, orders)
        row.status = "succeeded"
        row.status_reason = _done_reason(core)
        repo.touch(row)
        return row
    missing = [p for p in core.next_runs() if p.label not in by_label]
    if missing:
        try:
            with session.begin_nested():
                stored = _queue_cycle(
                    session, settings, row, request, core.next_runs(), missing, catalog
                )
        except (InvalidInputError, ConflictError) as exc:  # others (503s) are retried
            _write_result(row, request, core, by_label, metrics)
            _keep_orders(row, orders)
            row.status = "failed"
            row.status_reason = f"{exc.code}: {exc.detail}"[:4000]
            log.warning("campaign %s: cycle refused: %s", row.id, exc.detail)
            repo.touch(row)
            return row
        by_label.update({r.campaign_label: r for r in stored if r.campaign_label})
    row.status = "running"
    _write_result(row, request, core, by_label, metrics)
    _keep_orders(row, orders)
    repo.touch(row)
    return row


def _queue_cycle(
    session: Session,
    settings: Settings,
    row: Campaign,
    request: CampaignRequest,
    cycle: list[PlannedRun],
    missing: list[PlannedRun],
    catalog: Callable[[], EngineArgCatalog] | None,
) -> list[Run]:
    """Store the runs of one cycle as one experiment, and the retries of runs lost to the
    infrastructure as :func:`orchestrator.tuning.cycles.retry_groups` groups them."""
    cat = catalog() if catalog is not None else load_catalog(settings)
    stored: list[Run] = []
    for group in experiments_of(cycle, missing):
        stored += _queue_experiment(session, settings, row, request, group, cat)
    return stored


def _queue_experiment(
    session: Session,
    settings: Settings,
    row: Campaign,
    request: CampaignRequest,
    cycle: list[PlannedRun],
    cat: EngineArgCatalog,
) -> list[Run]:
    """Store ``cycle`` (its first run the baseline) as one experiment
    (:mod:`orchestrator.tuning.cycles`)."""
    spec = parse_spec(cycle_doc(row, request, cycle), settings, cat)
    experiment = create_experiment(session, settings, spec, cat, resolver=engine_resolver(settings))
    experiment.submitted_by = f"campaign:{row.name}"[:200]
    ordered = label_runs(row, list(experiment.runs), cycle)
    for run in ordered:
        run.submitted_by = experiment.submitted_by
    session.flush()
    return ordered


def next_cycle_docs(
    session: Session, campaign_id: str, settings: Settings | None = None
) -> list[dict[str, Any]]:
    """The experiment documents :func:`advance` would submit for campaign ``campaign_id``
    now (read without a lock; a cycle, or the retries of runs lost to the infrastructure),
    empty when it would submit nothing: to ask vLLM about them before, with no database
    connection held (:func:`orchestrator.experiments.service.precheck`)."""
    row = CampaignRepository(session).get(campaign_id)
    if row is None or row.status in ENDED:
        return []
    try:
        request = CampaignRequest.model_validate(row.request)
        runs = CampaignRepository(session).runs(row.id)
        metrics = RunRepository(session).metrics_for([r.id for r in runs], _metric_names(request))
        _, hook = order_hook(session, settings, row, request, runs)
        slots = campaign_slots(session, settings, row, request, started=bool(runs))
        core, by_label = rebuild(request, runs, metrics, hook, row.created_at, slots)
        cycle = core.next_runs()
        missing = [p for p in cycle if p.label not in by_label]
        return [cycle_doc(row, request, group) for group in experiments_of(cycle, missing)]
    except (ValueError, ConflictError):
        return []  # advance says why


def _done_reason(core: CoreCampaign) -> str:
    """What the finished campaign found, in one line: the changes adopted (or none), the
    candidates it left undecided (``unknown``: the budget ran out, runs not measured), and
    a confirmation that does not agree with the path, first when it does not."""
    steps = core.path()
    unknown = [c for c in core.candidates() if c.outcome is Outcome.UNKNOWN]
    confirmed = core.confirmed()
    parts: list[str] = []
    if confirmed is not None and not confirmed.agrees:
        parts.append(
            "the confirmation does NOT agree with the path: the final configuration measured "
            f"{confirmed.total.describe()} against the start, the steps "
            f"{confirmed.steps.describe()}"
        )
    if steps:
        moved = ", ".join(
            f"{s.variable}: {show_level(s.from_level)} -> {show_level(s.to_level)}" for s in steps
        )
        parts.append(f"{len(steps)} change(s) adopted: {moved}")
    elif unknown:
        parts.append("no change adopted: the starting configuration stays")
    else:
        parts.append("no candidate paid: the starting configuration stays")
    if unknown:
        parts.append(f"{len(unknown)} candidate(s) left undecided ({unknown[-1].reason})")
    return "; ".join(parts)


def _write_result(
    row: Campaign,
    request: CampaignRequest,
    core: CoreCampaign,
    by_label: dict[str | None, Run],
    metrics: dict[str, dict[str, float]],
) -> None:
    """``row.result`` from the core's state (JSON), with the incumbent (the final
    configuration once done) as a ``serve_command`` and a re-run ``spec``
    (:func:`orchestrator.tuning.final_config.final_result`), and why each run measured
    again was (``retry_reasons``, from the runs and their ``metrics``)."""
    cumulative = core.cumulative()
    confirmation = core.confirmed()
    proposal = (row.result or {}).get("space_proposal")  # the intake's, kept
    row.result = {
        **({"space_proposal": proposal} if proposal else {}),
        "phase": core.phase.value,
        "slots": core.slots,
        "runs_used": core.runs_used,
        "budget": core.budget,
        "start": dict(core.start),
        "incumbent": dict(core.incumbent),
        "path": [{**s.model_dump(mode="json"), "effect": s.gain.describe()} for s in core.path()],
        "candidates": [
            {
                **c.model_dump(mode="json"),
                "label": c.candidate.label,
                "effect": c.gain.describe() if c.gain is not None else None,
            }
            for c in core.candidates()
        ],
        "cumulative": cumulative.model_dump(mode="json") if cumulative else None,
        "confirmation": confirmation.model_dump(mode="json") if confirmation else None,
        "pending": [p.label for p in core.next_runs()],
        "runs": {
            label: {"id": r.id, "status": r.status, "experiment_id": r.experiment_id}
            for label, r in by_label.items()
            if label
        },
        "retried": core.retries(),
        "retry_reasons": _retry_reasons(core, by_label, metrics, request.objective.metric),
        "unmeasured": core.unmeasured(),
        "wall_time": wall_time(row, [r for label, r in by_label.items() if label]),
        **final_result(request, dict(core.incumbent)),
    }


def advance_campaigns(factory: sessionmaker[Session], settings: Settings) -> int:
    """A turn of the dispatcher's ``campaigns`` loop: :func:`advance` every queued or
    running campaign, each in its own unit of work (one that fails is logged and the
    next goes on; a database outage is raised). The cycle a campaign is about to queue is
    asked of vLLM first with no database connection held (:func:`next_cycle_docs`), so the
    check inside the locked advance reuses the answers. Returns how many were advanced."""
    with unit_of_work(factory) as session:
        ids = CampaignRepository(session).advancing_ids()
    cache: dict[str, EngineArgCatalog] = {}

    def catalog() -> EngineArgCatalog:
        if "c" not in cache:
            cache["c"] = load_catalog(settings)
        return cache["c"]

    done = 0
    for campaign_id in ids:
        try:
            with remembered_checks():
                with unit_of_work(factory) as session:
                    docs = next_cycle_docs(session, campaign_id, settings)
                for doc in docs:  # vLLM's answers with no connection held, reused below
                    precheck(settings, catalog(), doc)
                with unit_of_work(factory) as session:
                    if advance(session, settings, campaign_id, catalog=catalog) is not None:
                        done += 1
        except Exception as exc:
            if is_unavailable(exc):
                raise
            log.exception("campaign %s: advance failed", campaign_id)
    return done


def cancel_campaign(session: Session, campaign_id: str, by: str | None = None) -> Campaign:
    """Cancel a campaign: its queued runs end ``cancelled``, it ends ``cancelled``; runs
    already started finish and are kept. 409 ``campaign_already_ended`` when it ended."""
    repo = CampaignRepository(session)
    row = repo.get(campaign_id, for_update=True)
    if row is None:
        raise NotFoundError(f"no campaign {campaign_id}", code_hint="campaign_not_found")
    if row.status in ENDED:
        raise ConflictError(
            f"campaign {campaign_id} already ended ({row.status}); nothing to cancel",
            code_hint="campaign_already_ended",
        )
    runs = RunRepository(session)
    for run in repo.runs(row.id):
        if run.status == RunStatus.QUEUED.value:
            if by is not None:
                run.cancelled_by = by
            runs.transition(run, RunStatus.CANCELLED, "its campaign was cancelled")
    row.status = "cancelled"
    row.status_reason = f"cancelled by {by}" if by else "cancelled"
    result = dict(row.result or {})
    labelled = [r for r in repo.runs(row.id) if r.campaign_label]
    result["runs"] = {
        r.campaign_label: {"id": r.id, "status": r.status, "experiment_id": r.experiment_id}
        for r in labelled
    }
    result["pending"] = []
    result["candidates"] = [
        {**c, "outcome": "unknown", "reason": "the campaign was cancelled before it was decided"}
        if c.get("outcome") == "measuring"
        else c
        for c in result.get("candidates", [])
    ]
    result["wall_time"] = wall_time(row, labelled)
    row.result = result
    repo.touch(row)
    return row
