"""Submitting experiments: a spec document -> checks -> an experiment with its queued runs.

The checks are :func:`orchestrator.experiments.submission.check_experiment` (expand the
spec, check its engine arguments, resolve its model and plan it against the live cluster
and vLLM, each once); :func:`store_experiment` stores what passed. The API's submission is
:func:`orchestrator.experiments.intake.accept_experiment` (check with no database
connection held, then store); :func:`create_experiment` (scheduled sweeps) checks inside
the caller's transaction. :func:`submit_variant` adds one variant to an experiment. A
run's launch job and its result live in :mod:`orchestrator.runs`.

Services take a session and never commit; the caller's unit of work does. The
exception is :func:`submit_variant` (the API's): it commits the caller's transaction
once, after its reads, because vLLM's configuration check (6-80 s cold) must run with
no database connection held; it stores the result in a new transaction of the same
session.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

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
from orchestrator.experiments.model_resolution import ResolvedModel
from orchestrator.experiments.planner import RequestLists, Resolver
from orchestrator.experiments.run_layout import PlannedRun
from orchestrator.experiments.spec import ExperimentSpec, PlannedVariant, Variant
from orchestrator.experiments.submission import (
    CheckedExperiment,
    check_experiment,
    screen_experiment,
)


def parse_spec(body: Any, settings: Settings, catalog: EngineArgCatalog) -> ExperimentSpec:
    """Validate a submitted spec document; on failure report every problem at once.

    Schema problems (pydantic), the spec's own rules, unknown or ill-typed engine
    arguments and an unknown model are collected together into one
    :class:`SpecInvalidError` (locations start with ``body``):
    :func:`orchestrator.experiments.submission.screen_experiment`.
    """
    return screen_experiment(settings, catalog, body).spec


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
    check_experiment(
        settings, catalog, ClusterView.read(session, settings), spec, resolver=resolver
    )


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
    the API checks with no connection held instead
    (:func:`orchestrator.experiments.intake.accept_experiment`).
    """
    cluster = ClusterView.read(session, settings)
    checked = check_experiment(settings, catalog, cluster, spec, resolver=resolver)
    return store_experiment(session, checked, catalog)


def precheck(settings: Settings, catalog: EngineArgCatalog, doc: Any) -> None:
    """Ask vLLM about the configurations of spec document ``doc`` using no database,
    inside :func:`orchestrator.experiments.config_check.remembered_checks`, so that checking
    it again there in a transaction (:func:`validate_spec`) reuses the answers instead of
    holding a connection during vLLM's check. Reports nothing: problems are reported by
    that later check (which also knows the cluster)."""
    with contextlib.suppress(SpecInvalidError):
        check_experiment(settings, catalog, ClusterView(), doc, resolver=engine_resolver(settings))


def store_experiment(
    session: Session, c: CheckedExperiment, catalog: EngineArgCatalog
) -> Experiment:
    """Store checked experiment ``c`` with all its runs (``queued``) in ``session``'s
    transaction (the caller's unit of work commits)."""
    spec, model, plan, lists = c.spec, c.model, c.plan, c.request_lists
    experiment = Experiment(
        name=spec.name,
        description=spec.description,
        spec=spec.model_dump(mode="json"),
        model_id=model.model_id,
        model_digest=model.digest,
        model_revision=model.revision,
        request_list_hash=lists.hash(plan.variants[0].config.workload),
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
    _store_runs(session, experiment, plan.runs, model, catalog, lists, {})
    repo.reload(experiment)
    return experiment


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
    lists: RequestLists,
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
            request_list_hash=lists.hash(v.config.workload),
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
    checked: CheckedExperiment
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
        checked = check_experiment(settings, catalog, cluster, doc, resolver=resolver)
    except SpecInvalidError as exc:
        new_loc = ["body", "variants", len(doc["variants"]) - 1]
        raise SpecInvalidError(
            [
                {**e, "loc": ["body", *e["loc"][3:]]} if e["loc"][:3] == new_loc else e
                for e in exc.errors
            ]
        ) from exc
    return _CheckedVariant(checked, variant, added)


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
    model, lists = c.checked.model, c.checked.request_lists
    return _store_runs(
        session, experiment, new_runs, model, catalog, lists, existing, sequence_offset=offset
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
