"""Submitting experiments: a spec document -> checks -> an experiment with its queued runs.

:func:`parse_spec` validates the document; :func:`submit_experiment` (the API) and
:func:`create_experiment` (scheduled sweeps) expand the spec once, resolve its model
(:mod:`orchestrator.experiments.model_resolution`), plan it against the live cluster
(:mod:`orchestrator.experiments.planner`, :class:`ClusterView`) and store the runs;
:func:`submit_variant` adds one variant to an experiment. A run's launch job and its
result live in :mod:`orchestrator.runs`.

Services take a session and never commit; the caller's unit of work does. The
exceptions are :func:`submit_experiment` and :func:`submit_variant` (the API's
submissions): they commit the caller's transaction once, after their reads,
because vLLM's configuration check (6-80 s cold) must run with no database
connection held; they store the result in a new transaction of the same session.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from jobs.load.workload import build_requests, request_list_hash
from jobs.modelgen.generator import load_tokenizer
from jobs.schemas import WorkloadSpec
from orchestrator.cluster.placement import RAY_EXECUTOR_ON_CPU
from orchestrator.core.db import release_connection
from orchestrator.core.errors import ConflictError, NotFoundError, SpecInvalidError
from orchestrator.core.models import Experiment, Run
from orchestrator.core.repositories import ExperimentRepository, RunRepository
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus
from orchestrator.experiments.capacity_spec import search_time_bound
from orchestrator.experiments.cluster_view import ClusterView
from orchestrator.experiments.config_check import engine_resolver, remembered_checks
from orchestrator.experiments.engine_catalog import EngineArgCatalog
from orchestrator.experiments.model_resolution import ResolvedModel, resolve_model
from orchestrator.experiments.planner import Plan, PlannedRun, Resolver, plan_experiment
from orchestrator.experiments.spec import (
    Expansion,
    ExperimentSpec,
    PlannedVariant,
    Variant,
    expand,
)


def parse_spec(body: Any, settings: Settings, catalog: EngineArgCatalog) -> ExperimentSpec:
    """Validate a submitted spec document; on failure report every problem at once.

    Schema problems (pydantic), unknown or ill-typed engine arguments found in
    the raw document, and an unknown model are collected together into one
    :class:`SpecInvalidError` (locations start with ``body``).
    """
    try:
        return ExperimentSpec.model_validate(body)
    except ValidationError as exc:
        errors = SpecInvalidError.from_validation(exc).errors
    if not isinstance(body, dict):
        raise SpecInvalidError(errors)
    baseline = body.get("baseline")
    if isinstance(baseline, dict) and isinstance(baseline.get("engine_args"), dict):
        errors += catalog.check(baseline["engine_args"], ["body", "baseline", "engine_args"])
    variants = body.get("variants")
    for i, v in enumerate(variants if isinstance(variants, list) else []):
        changes = v.get("changes") if isinstance(v, dict) else None
        for path, value in (changes if isinstance(changes, dict) else {}).items():
            if isinstance(path, str) and path.startswith("engine_args."):
                for err in catalog.check({path.split(".", 1)[1]: value}, []):
                    errors.append({**err, "loc": ["body", "variants", i, "changes", path]})
    revision_bad = any(e.get("loc", [])[:2] == ["body", "revision"] for e in errors)
    if isinstance(body.get("model"), str) and body["model"] and not revision_bad:
        revision = body.get("revision") if isinstance(body.get("revision"), str) else None
        try:
            resolve_model(settings, body["model"], revision)
        except SpecInvalidError as exc:
            errors += exc.errors
    raise SpecInvalidError(errors)


def validate_spec(
    session: Session,
    settings: Settings,
    spec: ExperimentSpec,
    catalog: EngineArgCatalog,
    *,
    resolver: Resolver | None = None,
) -> None:
    """Every check :func:`create_experiment` makes (the spec's rules, its model, the plan
    against the live cluster read in ``session``, vLLM's through ``resolver``), storing
    nothing. Raises :class:`SpecInvalidError` listing every problem."""
    model, expanded = _model_for(settings, spec)
    plan = _plan_for(ClusterView.read(session, settings), spec, expanded, catalog, model, resolver)
    if plan.errors:
        raise SpecInvalidError(plan.errors)


def _plan_for(
    cluster: ClusterView,
    spec: ExperimentSpec,
    expanded: Expansion,
    catalog: EngineArgCatalog,
    model: ResolvedModel,
    resolver: Resolver | None,
) -> Plan:
    """:func:`plan_experiment` for ``spec`` (``expanded``: its :func:`expand`) on ``model``,
    checked against ``cluster``.

    A variant with ``layout.executor: "ray"`` is refused when the device kind in force
    is CPU (the CPU build of vLLM refuses the Ray executor). Uses no database.
    """
    variants = expanded[0]
    if model.resolution.get("offline") and model.resolution.get("weights_cached") is False:
        missing = [v.name for v in variants if v.config.engine_args.get("load_format") != "dummy"]
        if missing:
            return Plan(
                variants=variants,
                errors=[
                    {
                        "loc": ["body", "model"],
                        "msg": f"{model.model_id} @ {model.revision}: the node's Hugging Face "
                        f"cache ({model.resolution.get('hf_cache')}) has its config and "
                        "tokenizer but no weights, and HF_HUB_OFFLINE=1 there, so vLLM cannot "
                        "load it; download the weights into that cache, or set "
                        "engine_args.load_format 'dummy' (random weights) for: "
                        f"{', '.join(missing)}",
                        "type": "model_weights_missing",
                    }
                ],
            )
    if cluster.kind == "CPU":
        # before vLLM's (slow) configuration check: nothing else matters for these
        refused = [
            {
                "loc": _executor_loc(spec, v),
                "msg": f"{v.name}: {RAY_EXECUTOR_ON_CPU}",
                "type": "executor_unsupported",
            }
            for v in variants
            if v.config.layout.executor == "ray"
        ]
        if refused:
            return Plan(variants=variants, errors=refused)
    return plan_experiment(
        spec,
        catalog,
        model_dir=str(model.path),
        model_digest=model.digest,
        generated_model=model.generated,
        cluster_devices=cluster.devices,
        resolver=resolver,
        model_max_len=model.max_position_embeddings,
        cluster_nodes=cluster.nodes,
        expanded=expanded,
    )


def _executor_loc(spec: ExperimentSpec, v: PlannedVariant) -> list[str | int]:
    """Where a variant's ``layout.executor`` comes from in the submitted document."""
    if v.source == "variant" and "layout.executor" in v.changes:
        index = next(i for i, x in enumerate(spec.variants) if x.name == v.name)
        return ["body", "variants", index, "changes", "layout.executor"]
    if v.source == "factor":
        return ["body", "factors", v.variable or ""]
    return ["body", "baseline", "layout", "executor"]


def create_experiment(
    session: Session,
    settings: Settings,
    spec: ExperimentSpec,
    catalog: EngineArgCatalog,
    *,
    resolver: Resolver | None = None,
) -> Experiment:
    """Check ``spec`` and store the experiment with all its runs (``queued``).

    Raises :class:`SpecInvalidError` listing every problem; nothing is stored then.
    The check (vLLM's, through ``resolver``) runs inside the caller's transaction:
    the API uses :func:`submit_experiment` instead.
    """
    model, expanded = _model_for(settings, spec)
    cluster = ClusterView.read(session, settings)
    checked = _check_experiment(cluster, spec, expanded, catalog, model, resolver)
    return _store_experiment(session, checked, catalog)


def submit_experiment(
    session: Session,
    settings: Settings,
    spec: ExperimentSpec,
    catalog: EngineArgCatalog,
    *,
    resolver: Resolver | None = None,
) -> Experiment:
    """:func:`create_experiment` holding no database connection during the check.

    The cluster's state is read, then the caller's transaction is committed
    (:func:`orchestrator.core.db.release_connection`: its connection goes back to the pool);
    the model, vLLM's check and the request lists are computed with no connection
    held; the experiment is stored in a new transaction of ``session``, which the
    caller's unit of work commits. Errors as :func:`create_experiment`, plus 503
    ``submissions_busy`` from ``resolver``.
    """
    cluster = ClusterView.read(session, settings)
    release_connection(session)
    model, expanded = _model_for(settings, spec)
    checked = _check_experiment(cluster, spec, expanded, catalog, model, resolver)
    return _store_experiment(session, checked, catalog)


def precheck(settings: Settings, catalog: EngineArgCatalog, doc: Any) -> None:
    """Ask vLLM about the configurations of spec document ``doc`` using no database,
    inside :func:`orchestrator.experiments.config_check.remembered_checks`, so that checking
    it again there in a transaction (:func:`validate_spec`) reuses the answers instead of
    holding a connection during vLLM's check. Reports nothing: problems are reported by
    that later check (which also knows the cluster)."""
    try:
        spec = parse_spec(doc, settings, catalog)
        model, expanded = _model_for(settings, spec)
    except SpecInvalidError:
        return
    _plan_for(ClusterView(), spec, expanded, catalog, model, engine_resolver(settings))


def _model_for(settings: Settings, spec: ExperimentSpec) -> tuple[ResolvedModel, Expansion]:
    """The spec's model and its expansion (:func:`expand`: done once per submission and
    handed on to the planner). Raises :class:`SpecInvalidError` on the spec's own rules
    before the model is looked up."""
    expanded = expand(spec)
    if expanded[1]:
        raise SpecInvalidError(expanded[1])
    return resolve_model(settings, spec.model, spec.revision), expanded


@dataclass
class _Checked:
    """A spec that passed every check, with what storing it needs."""

    spec: ExperimentSpec
    model: ResolvedModel
    plan: Plan
    hasher: _RequestListHasher


def _check_experiment(
    cluster: ClusterView,
    spec: ExperimentSpec,
    expanded: Expansion,
    catalog: EngineArgCatalog,
    model: ResolvedModel,
    resolver: Resolver | None,
) -> _Checked:
    """Plan ``spec`` and build its request lists (no database). Raises
    :class:`SpecInvalidError` with every problem."""
    plan = _plan_for(cluster, spec, expanded, catalog, model, resolver)
    if plan.errors:
        raise SpecInvalidError(plan.errors)
    return _Checked(spec, model, plan, _hashed(model, plan))


def _hashed(model: ResolvedModel, plan: Plan) -> _RequestListHasher:
    """A hasher that already holds every workload's request list hash of ``plan``."""
    hasher = _RequestListHasher(model.path)
    for v in plan.variants:
        hasher(v.config.workload)
    return hasher


def _store_experiment(session: Session, c: _Checked, catalog: EngineArgCatalog) -> Experiment:
    spec, model, plan, hasher = c.spec, c.model, c.plan, c.hasher
    experiment = Experiment(
        name=spec.name,
        description=spec.description,
        spec=spec.model_dump(mode="json"),
        model_id=model.model_id,
        model_digest=model.digest,
        model_revision=model.revision,
        request_list_hash=hasher(plan.variants[0].config.workload),
        repeats=spec.repeats,
        variants=[_variant_doc(v) for v in plan.variants],
    )
    if plan.pinned:
        experiment.spec = {**experiment.spec, "pinned_engine_args": plan.pinned}
    if model.resolution:
        experiment.spec = {**experiment.spec, "model_resolution": model.resolution}
    if spec.capacity is not None:  # how long each run's search can take, at most
        bound = search_time_bound(spec.capacity, len(plan.runs))
        experiment.spec = {**experiment.spec, "capacity_estimate": bound}
    repo = ExperimentRepository(session)
    repo.add(experiment)
    _store_runs(session, experiment, plan.runs, model, catalog, hasher, {})
    repo.reload(experiment)
    return experiment


class _RequestListHasher:
    """Hash of each distinct workload's request list, built with the model's tokenizer."""

    def __init__(self, model_path: Path) -> None:
        self.tokenizer = load_tokenizer(model_path)
        self.hashes: dict[str, str] = {}

    def __call__(self, workload: WorkloadSpec) -> str:
        key = workload.model_dump_json()
        if key not in self.hashes:
            self.hashes[key] = request_list_hash(build_requests(workload, self.tokenizer))
        return self.hashes[key]


def _variant_doc(v: PlannedVariant) -> dict[str, Any]:
    return {
        "name": v.name,
        "position": v.position,
        "reference": v.reference,
        "variable": v.variable,
        "variable_paths": v.variable_paths,
        "changes": v.changes,
        "source": v.source,
    }


def _store_runs(
    session: Session,
    experiment: Experiment,
    runs: list[PlannedRun],
    model: ResolvedModel,
    catalog: EngineArgCatalog,
    hasher: _RequestListHasher,
    run_ids: dict[tuple[str, int], str],
    sequence_offset: int = 0,
) -> list[Run]:
    """Insert ``runs`` (queued); ``run_ids`` maps (variant, repeat) to existing run ids."""
    stored = []
    for p in sorted(runs, key=lambda r: (r.variant.position, r.repeat_index)):
        v = p.variant
        explicit = p.explicit_engine_args
        run = Run(
            experiment_id=experiment.id,
            name=v.name,
            position=v.position,
            is_baseline=v.reference is None,
            reference_run_id=run_ids.get((v.reference, p.repeat_index)) if v.reference else None,
            reference_variant=v.reference,
            variable=v.variable,
            variable_paths=v.variable_paths,
            changes=v.changes,
            repeat_index=p.repeat_index,
            sequence=sequence_offset + p.sequence,
            server_key=p.server_key,
            resolved_config=p.resolved_config,
            status=RunStatus.QUEUED.value,
            progress={},
            engine_args=p.resolved_engine_args,
            explicit_engine_args=explicit,
            layout=v.config.layout.model_dump(mode="json"),
            workload=v.config.workload.model_dump(mode="json"),
            model_id=model.model_id,
            model_path=str(model.path),
            model_digest=model.digest,
            model_revision=model.revision,
            max_model_len=p.max_model_len,
            seed=v.config.workload.seed,
            request_list_hash=hasher(v.config.workload),
            vllm_version=catalog.vllm_version,
            engine_info={},
            timings={},
        )
        RunRepository(session).add(run)
        run_ids[(v.name, p.repeat_index)] = run.id
        stored.append(run)
    return stored


_SPEC_FACTS = ("pinned_engine_args", "model_resolution", "capacity_estimate")


def add_variant(
    session: Session,
    settings: Settings,
    catalog: EngineArgCatalog,
    run_id: str,
    variant: Variant,
    *,
    resolver: Resolver | None = None,
) -> list[Run]:
    """Clone run ``run_id``'s variant with one change: ``POST /runs/{id}/variants``.

    The new variant's reference is the cloned run's variant; it gets the
    experiment's repeat count, queued after the experiment's existing runs.
    Raises :class:`SpecInvalidError` under the same rules as a new experiment.
    The check runs inside the caller's transaction (the experiment row locked):
    the API uses :func:`submit_variant` instead.
    """
    run = get_run(session, run_id)
    experiment = ExperimentRepository(session).get(run.experiment_id, for_update=True)
    assert experiment is not None
    cluster = ClusterView.read(session, settings)
    c = _check_variant(cluster, settings, catalog, experiment.spec, run.name, variant, resolver)
    return _store_variant(session, experiment, c, catalog)


def submit_variant(
    session: Session,
    settings: Settings,
    catalog: EngineArgCatalog,
    run_id: str,
    variant: Variant,
    *,
    resolver: Resolver | None = None,
    attempts: int = 3,
) -> list[Run]:
    """:func:`add_variant` holding no database connection during the check.

    The experiment's spec and the cluster's state are read and the caller's
    transaction committed (:func:`orchestrator.core.db.release_connection`); the new
    variant is checked with no connection held; then, in a new transaction of
    ``session`` (committed by the caller), the experiment row is locked and the runs
    stored if its spec is still the one checked. If another variant was added
    meanwhile, the check is done again (vLLM's answers remembered), up to
    ``attempts`` times, then 409 ``experiment_busy``.
    """
    repo = ExperimentRepository(session)
    with remembered_checks():
        for _ in range(attempts):
            run = get_run(session, run_id)
            experiment = repo.get(run.experiment_id, fresh=True)
            assert experiment is not None
            seen = copy.deepcopy(experiment.spec)
            reference, cluster = run.name, ClusterView.read(session, settings)
            release_connection(session)
            c = _check_variant(cluster, settings, catalog, seen, reference, variant, resolver)
            experiment = repo.get(run.experiment_id, for_update=True, fresh=True)
            assert experiment is not None
            if experiment.spec == seen:
                repo.forget_runs(experiment)  # as they are now, under the lock
                return _store_variant(session, experiment, c, catalog)
    raise ConflictError(
        f"the experiment of run {run_id} kept changing while the variant was checked; "
        "submit it again",
        code_hint="experiment_busy",
    )


@dataclass
class _CheckedVariant:
    checked: _Checked
    variant: Variant
    #: facts the service added to the stored spec (not part of what a user submits)
    added: dict[str, Any]


def _check_variant(
    cluster: ClusterView,
    settings: Settings,
    catalog: EngineArgCatalog,
    stored_spec: dict[str, Any],
    reference: str,
    variant: Variant,
    resolver: Resolver | None = None,
) -> _CheckedVariant:
    """The experiment spec ``stored_spec`` with ``variant`` (referring to ``reference``)
    appended, planned and checked (no database). Raises :class:`SpecInvalidError`; the
    new variant's problems are located at ``body`` (the request's own body)."""
    added = {k: v for k, v in stored_spec.items() if k in _SPEC_FACTS}
    doc = {k: v for k, v in stored_spec.items() if k not in _SPEC_FACTS}
    variant = variant.model_copy(update={"reference": reference})
    doc["variants"] = [*doc.get("variants", []), variant.model_dump(mode="json")]
    try:
        spec = ExperimentSpec.model_validate(doc)
    except ValidationError as exc:
        raise SpecInvalidError.from_validation(exc) from exc
    model = resolve_model(settings, spec.model, spec.revision)
    plan = _plan_for(cluster, spec, expand(spec), catalog, model, resolver)
    if plan.errors:
        new_loc = ["body", "variants", len(spec.variants) - 1]
        raise SpecInvalidError(
            [
                {**e, "loc": ["body", *e["loc"][3:]]} if e["loc"][:3] == new_loc else e
                for e in plan.errors
            ]
        )
    return _CheckedVariant(_Checked(spec, model, plan, _hashed(model, plan)), variant, added)


def _store_variant(
    session: Session, experiment: Experiment, c: _CheckedVariant, catalog: EngineArgCatalog
) -> list[Run]:
    new_runs = [p for p in c.checked.plan.runs if p.variant.name == c.variant.name]
    existing = {(r.name, r.repeat_index): r.id for r in experiment.runs}
    offset = max((r.sequence for r in experiment.runs), default=-1) + 1
    first = min(p.sequence for p in new_runs)
    for p in new_runs:
        p.sequence -= first
    experiment.spec = {**c.checked.spec.model_dump(mode="json"), **c.added}
    experiment.variants = [*experiment.variants, _variant_doc(new_runs[0].variant)]
    model, hasher = c.checked.model, c.checked.hasher
    return _store_runs(
        session, experiment, new_runs, model, catalog, hasher, existing, sequence_offset=offset
    )


def get_experiment(session: Session, experiment_id: str) -> Experiment:
    exp = ExperimentRepository(session).get(experiment_id)
    if exp is None:
        raise NotFoundError(f"no experiment {experiment_id}", code_hint="experiment_not_found")
    return exp


def get_run(session: Session, run_id: str, *, for_update: bool = False) -> Run:
    run = RunRepository(session).get(run_id, for_update=for_update)
    if run is None:
        raise NotFoundError(f"no run {run_id}", code_hint="run_not_found")
    return run
