"""A campaign as the API submits it: one call per request.

The request is read (:class:`orchestrator.tuning.campaign_request.CampaignRequest`), its
space checked (every ``engine_args`` level against vLLM's argument catalogue, every
variable's starting level one of its levels, the budget large enough to confirm), and the
experiment its first round would submit (the start as the baseline, every one-variable
neighbour as a variant) checked as ``POST /experiments`` checks one: asked of vLLM with no
database connection held inside a check slot (503 ``submissions_busy``), then validated
against the live cluster reusing those answers. Every problem is one 422
``campaign_invalid``; nothing is stored then. The caller's unit of work commits.

A space of ``"auto"`` is proposed first (:func:`auto_space`, the rules of
:mod:`orchestrator.tuning.auto_space`) and checked as a listed one; the proposal's notes
are kept with the campaign (``result["space_proposal"]``).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from orchestrator.campaigns.space import Level, neighbours
from orchestrator.core.db import release_connection
from orchestrator.core.errors import CampaignInvalidError, SpecInvalidError
from orchestrator.core.models import Campaign
from orchestrator.core.repositories import CampaignRepository
from orchestrator.core.settings import Settings
from orchestrator.experiments.cluster_view import ClusterView
from orchestrator.experiments.config_check import engine_resolver, gate_for, remembered_checks
from orchestrator.experiments.engine_catalog import EngineArgCatalog, load_catalog
from orchestrator.experiments.model_resolution import resolve_model
from orchestrator.experiments.planner import LINKED_FACTOR_REMEDY
from orchestrator.experiments.service import parse_spec, precheck, validate_spec
from orchestrator.tuning.auto_space import AUTO_VARIABLES, propose_space
from orchestrator.tuning.campaign_request import (
    CAPACITY_OBJECTIVES,
    GPU_TELEMETRY,
    OBJECTIVES,
    CampaignRequest,
    SpaceVariable,
)
from orchestrator.tuning.evidence import Evidence
from orchestrator.tuning.evidence_inputs import gather_evidence


def accept_campaign(
    session: Session, settings: Settings, body: Any, submitted_by: str | None = None
) -> Campaign:
    """Check campaign document ``body`` and store the campaign ``queued`` (the dispatcher's
    ``campaigns`` loop queues its runs). 422 ``campaign_invalid`` names every bad field."""
    return CampaignRepository(session).add(checked_campaign(session, settings, body, submitted_by))


def checked_campaign(
    session: Session, settings: Settings, body: Any, submitted_by: str | None = None
) -> Campaign:
    """The campaign of document ``body``, checked as :func:`accept_campaign` checks it (422
    ``campaign_invalid``; 503 when vLLM cannot be asked now), ``queued`` and not stored.
    Commits the caller's transaction first: vLLM is asked with no connection held."""
    try:
        request = CampaignRequest.model_validate(body)
    except ValidationError as exc:
        raise CampaignInvalidError.from_validation(exc) from exc
    release_connection(session)  # nothing held while waiting for a slot or for vLLM
    proposal: list[dict[str, Any]] | None = None
    with gate_for(settings).slot(), remembered_checks():
        if request.auto_space:
            request, proposal = auto_space(session, settings, request)
        catalog = load_catalog(settings)
        doc = first_round(request, catalog)
        precheck(settings, catalog, doc)  # vLLM's answers, no connection held
        try:
            spec = parse_spec(doc, settings, catalog)
            validate_spec(session, settings, spec, catalog, resolver=engine_resolver(settings))
        except SpecInvalidError as exc:
            raise CampaignInvalidError(_relocated(request, exc.errors)) from exc
        if problems := telemetry_problems(request, ClusterView.read(session, settings)):
            raise CampaignInvalidError(problems)
    stored = request.model_copy(  # what the defaults resolved to, as the campaign runs it
        update={
            "objective": request.objective.model_copy(
                update={"direction": request.objective.resolved_direction}
            ),
            "space": [
                v.model_copy(update={"start": request.start_level(v)}) for v in request.variables()
            ],
        }
    )
    return Campaign(
        name=request.name,
        status="queued",
        request=stored.model_dump(mode="json"),
        result={} if proposal is None else {"space_proposal": proposal},
        submitted_by=submitted_by,
    )


#: Where vLLM's resolved configuration holds each proposed variable's value.
RESOLVED_KEYS = {
    "engine_args.enable_prefix_caching": "cache_config.enable_prefix_caching",
    "engine_args.max_num_seqs": "scheduler_config.max_num_seqs",
    "engine_args.max_num_batched_tokens": "scheduler_config.max_num_batched_tokens",
    "engine_args.max_model_len": "model_config.max_model_len",
    "layout.tensor_parallel_size": "parallel_config.tensor_parallel_size",
}


def auto_space(
    session: Session, settings: Settings, request: CampaignRequest
) -> tuple[CampaignRequest, list[dict[str, Any]]]:
    """``request`` with its ``"auto"`` space replaced by vlab's proposal, and the
    proposal's notes. Inside the intake's check slot and :func:`remembered_checks`: the
    evidence is read as the tuning service reads it (no runs yet), the starts are the
    baseline's values, else vLLM's resolved configuration of the baseline (one call, no
    connection held). 422 ``space_auto_empty`` when nothing is proposed."""
    evidence = gather_evidence(session, settings, request, [])
    release_connection(session)
    starts = auto_starts(settings, request, evidence)
    proposal = propose_space(evidence, starts, request.objective.metric.endswith("_ms"))
    if not proposal.variables:
        raise CampaignInvalidError(
            [
                {
                    "loc": ["body", "space"],
                    "msg": "vlab proposes no variable for this campaign: "
                    + "; ".join(f"{n['name']}: {n['why']}" for n in proposal.notes),
                    "type": "space_auto_empty",
                }
            ]
        )
    space = [SpaceVariable.model_validate(v) for v in proposal.variables]
    return request.model_copy(update={"space": space}), proposal.notes


def auto_starts(
    settings: Settings, request: CampaignRequest, evidence: Evidence
) -> dict[str, Level | None]:
    """Each proposed variable's start: the baseline's value, else vLLM's resolved value
    of the baseline's engine arguments (when the resolver is enabled), else None; the
    layout's tensor parallel size defaults to 1 as an experiment's does."""
    starts = {name: request.baseline_value(name) for name in AUTO_VARIABLES}
    resolver = engine_resolver(settings)
    if resolver is not None and evidence.model.model_dir is not None and None in starts.values():
        layout = request.baseline.get("layout") or {}
        args: dict[str, Any] = {}
        if resolve_model(settings, request.model, request.revision).generated:
            args["load_format"] = "dummy"  # as a run of a generated model launches
        args.update(request.baseline.get("engine_args") or {})
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            args[key] = layout.get(key, 1) if isinstance(layout, dict) else 1
        (answer,) = resolver(str(evidence.model.model_dir), [args])
        config = (answer.get("config") or {}) if answer.get("ok") else {}
        for name, key in RESOLVED_KEYS.items():
            value = config.get(key)
            if starts.get(name) is None and isinstance(value, bool | int | float | str):
                starts[name] = value
    if starts.get("layout.tensor_parallel_size") is None:
        starts["layout.tensor_parallel_size"] = 1
    return starts


def metric_problems(request: CampaignRequest) -> list[dict[str, Any]]:
    """The problems of the request's objective and constraints (each a stored run metric
    a campaign can decide from, the objective in its own direction)."""
    errors: list[dict[str, Any]] = []

    def bad(loc: list[str | int], msg: str, kind: str) -> None:
        errors.append({"loc": ["body", *loc], "msg": msg, "type": kind})

    if request.objective.metric not in OBJECTIVES:
        bad(
            ["objective", "metric"],
            f"{request.objective.metric!r} is not a stored run metric a campaign can "
            f"optimise; one of {', '.join(OBJECTIVES)}",
            "objective_unknown",
        )
    elif (
        request.objective.direction is not None
        and request.objective.direction != OBJECTIVES[request.objective.metric]
    ):
        bad(
            ["objective", "direction"],
            f"{request.objective.metric} improves when "
            f"{OBJECTIVES[request.objective.metric].value}, not "
            f"{request.objective.direction.value}",
            "objective_direction",
        )
    searching = request.capacity is not None
    if request.objective.metric in OBJECTIVES and searching != (
        request.objective.metric in CAPACITY_OBJECTIVES
    ):
        bad(
            ["objective", "metric"] if not searching else ["capacity"],
            f"{request.objective.metric} needs a capacity search (`capacity`)"
            if not searching
            else "with a capacity search the objective is capacity or capacity_per_device, "
            f"not {request.objective.metric} (the numbers of the step the search kept)",
            "objective_capacity",
        )
    for i, c in enumerate(request.constraints):
        if c.metric not in OBJECTIVES:
            bad(
                ["constraints", i, "metric"],
                f"{c.metric!r} is not a stored run metric a constraint can hold; one of "
                f"{', '.join(OBJECTIVES)}",
                "constraint_unknown",
            )
    return errors


def telemetry_problems(request: CampaignRequest, view: ClusterView) -> list[dict[str, Any]]:
    """An objective or constraint only GPU telemetry gives (J/token), on a live cluster
    of CPU devices: refused, since no run of it could be measured (an unknown cluster is
    not refused)."""
    if view.devices is None or (view.kind or "").upper() != "CPU":
        return []
    named: list[tuple[list[str | int], str]] = [(["objective", "metric"], request.objective.metric)]
    named += [(["constraints", i, "metric"], c.metric) for i, c in enumerate(request.constraints)]
    return [
        {
            "loc": ["body", *loc],
            "msg": f"{metric} needs GPU energy telemetry (NVML); this cluster's devices are CPUs",
            "type": "objective_needs_gpu",
        }
        for loc, metric in named
        if metric in GPU_TELEMETRY
    ]


def variable_problems(request: CampaignRequest, catalog: EngineArgCatalog) -> list[dict[str, Any]]:
    """The problems of each space variable on its own: an engine argument vLLM lacks (said
    once, nothing else of it), a level vLLM refuses, a start missing or contradicting the
    baseline's value."""
    errors: list[dict[str, Any]] = []

    def bad(loc: list[str | int], msg: str, kind: str) -> None:
        errors.append({"loc": ["body", "space", *loc], "msg": msg, "type": kind})

    for i, v in enumerate(request.variables()):
        section, name = v.name.split(".", 1)
        unknown = False
        if section == "engine_args":
            for j, level in enumerate(v.levels):
                for err in catalog.check({name: level}, []):
                    if err["type"] != "unknown_engine_arg" or not unknown:
                        bad([i, "levels", j], err.get("msg", "invalid"), err["type"])
                    unknown = unknown or err["type"] == "unknown_engine_arg"
        start = request.start_level(v)
        if unknown:
            continue
        if start is None:
            bad(
                [i, "start"],
                f"the baseline does not set {v.name}: give its starting level",
                "start_missing",
            )
        elif v.start is not None and request.baseline_value(v.name) not in (None, v.start):
            bad(
                [i, "start"],
                f"the baseline sets {v.name} to {request.baseline_value(v.name)!r} and the "
                f"space starts it at {v.start!r}: give one of them (leave out start to begin "
                "from the baseline's value)",
                "start_conflicts_baseline",
            )
    return errors


def first_round(request: CampaignRequest, catalog: EngineArgCatalog) -> dict[str, Any]:
    """The experiment document of the campaign's first round (the start as the baseline,
    each one-variable neighbour a variant named by its index); raises
    :class:`CampaignInvalidError` with every problem of the space, objective and budget."""
    errors: list[dict[str, Any]] = []

    def bad(loc: list[str | int], msg: str, kind: str) -> None:
        errors.append({"loc": ["body", *loc], "msg": msg, "type": kind})

    errors += metric_problems(request) + variable_problems(request, catalog)
    try:
        space = request.core_space()
    except ValidationError as exc:
        names = [v.name for v in request.variables()]
        for e in exc.errors():
            loc, msg = e["loc"][1:], str(e["msg"]).removeprefix("Value error, ")
            if loc and isinstance(loc[0], int) and loc[0] < len(names):
                msg = f"{names[loc[0]]}: {msg}"
            bad(["space", *loc], msg, e["type"])
        raise CampaignInvalidError(errors) from exc
    for i, v in enumerate(request.variables()):
        start = request.start_level(v)
        if start is not None:
            try:
                space.variables[i].index(start)
            except ValueError as exc:
                bad(["space", i, "start"], str(exc), "start_not_a_level")
    reserve = 2 * request.rule.max_repeats
    if request.budget.max_runs < reserve + 2:
        bad(
            ["budget", "max_runs"],
            f"{request.budget.max_runs} runs leave no room: the confirmation takes {reserve} "
            "(2 x rule.max_repeats) and a round at least 2",
            "budget_too_small",
        )
    if errors:
        raise CampaignInvalidError(errors)
    start_config = request.start()
    variants = [
        {"name": f"candidate {k}", "changes": {c.variable: c.to_level}}
        for k, c in enumerate(neighbours(start_config, space))
    ]
    try:
        return request.experiment_doc(f"{request.name} check", start_config, variants)
    except KeyError as exc:  # a section of the baseline that is not an object
        raise CampaignInvalidError(
            [
                {
                    "loc": ["body", "baseline", str(exc.args[0]).split(".", 1)[0]],
                    "msg": f"cannot set {exc.args[0]}: its section is not an object",
                    "type": "baseline_invalid",
                }
            ]
        ) from exc


def _relocated(request: CampaignRequest, errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first round's problems where the campaign request has them: the baseline's
    under ``body.baseline``, a variant's at its variable in ``body.space``."""
    names = [v.name for v in request.variables()]
    out = []
    for e in errors:
        loc = list(e.get("loc", []))
        rest = loc[1:] if loc[:1] == ["body"] else loc
        if rest[:1] == ["variants"] and len(rest) >= 2 and isinstance(rest[1], int):
            changes = _first_round_variable(request, rest[1])
            where: list[Any] = ["space", names.index(changes)] if changes in names else ["space"]
            hint = _devices_hint(request, changes, e) or _pin_hint(changes, e)
            out.append({**e, "loc": ["body", *where], **hint})
        else:
            out.append({**e, "loc": ["body", *rest]})
    return out


#: The layout sizes whose product is the devices a run reserves unless ``layout.devices``
#: says otherwise: changing one alone changes the devices too.
_PARALLEL_SIZES = {
    "layout.tensor_parallel_size": "layout.pipeline_parallel_size",
    "layout.pipeline_parallel_size": "layout.tensor_parallel_size",
}


def _devices_hint(
    request: CampaignRequest, variable: str | None, error: dict[str, Any]
) -> dict[str, Any]:
    """For a TP or PP variable refused because the devices changed with it (the baseline
    leaves ``layout.devices`` to TP x PP): the message says how to change the size alone."""
    if (
        variable not in _PARALLEL_SIZES
        or error.get("type") != "more_than_one_variable"
        or "layout.devices" not in (error.get("variables") or {})
    ):
        return {}
    levels = next(v.levels for v in request.variables() if v.name == variable)
    other = request.baseline_value(_PARALLEL_SIZES[variable])
    sizes = [lv for lv in levels if isinstance(lv, int) and not isinstance(lv, bool)]
    devices = max(sizes, default=1) * (other if isinstance(other, int) else 1)
    return {
        "msg": f"{error['msg']}. Set layout.devices in the baseline (e.g. {devices}, the "
        f"largest {variable.split('.', 1)[1]} of the space times the other size) so that "
        f"only {variable} changes: each run then reserves the same devices"
    }


def _pin_hint(variable: str | None, error: dict[str, Any]) -> dict[str, Any]:
    """For a candidate refused because vLLM resolves another argument differently with it:
    the message names the arguments to pin in the baseline, with the starting values."""
    derived = error.get("variables") or {}
    msg = str(error.get("msg", ""))
    if error.get("type") != "derived_default_changes" or LINKED_FACTOR_REMEDY not in msg:
        return {}
    if not derived:
        return {}
    pins = ", ".join(
        f"engine_args.{k}: {json.dumps(v[0]) if isinstance(v, list) and v else v}"
        for k, v in derived.items()
    )
    return {
        "msg": msg.replace(
            LINKED_FACTOR_REMEDY,
            f"Pin {pins} in the baseline so that only {variable or 'the variable'} changes",
        )
    }


def _first_round_variable(request: CampaignRequest, index: int) -> str | None:
    try:
        cands = neighbours(request.start(), request.core_space())
        return cands[index].variable
    except (ValueError, IndexError):
        return None
