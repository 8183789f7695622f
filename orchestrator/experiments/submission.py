"""The check of a submission: a spec document -> a checked plan, going one way.

:func:`check_experiment` reads the document and expands the spec once
(:func:`read_spec`), checks its engine arguments once
(:meth:`orchestrator.experiments.engine_catalog.EngineArgCatalog.check_spec`), resolves
its model once (:func:`orchestrator.experiments.model_resolution.resolve_model`) and
plans it against the cluster and vLLM (:func:`orchestrator.experiments.planner.plan_submission`,
which builds each workload's request list once: :class:`RequestLists`). Nothing here
reads or writes the database: :func:`orchestrator.experiments.service.store_experiment`
stores the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import ValidationError

from orchestrator.core.errors import SpecInvalidError
from orchestrator.core.settings import Settings
from orchestrator.experiments.cluster_view import ClusterView
from orchestrator.experiments.engine_catalog import EngineArgCatalog
from orchestrator.experiments.model_resolution import ResolvedModel, resolve_model
from orchestrator.experiments.planner import Plan, RequestLists, Resolver, plan_submission
from orchestrator.experiments.spec import Expansion, ExperimentSpec, PlannedVariant, expand


class Screened(NamedTuple):
    """A spec whose document, expansion and model passed (:func:`screen_experiment`)."""

    spec: ExperimentSpec
    expanded: Expansion
    #: the problems of its engine arguments, reported with the plan's
    arg_errors: list[dict[str, Any]]
    model: ResolvedModel


@dataclass
class CheckedExperiment:
    """A spec that passed every check, with what storing it needs."""

    spec: ExperimentSpec
    model: ResolvedModel
    plan: Plan
    request_lists: RequestLists


@dataclass
class SpecReading:
    """A submitted spec document read once: the spec (None when the document does not
    validate) and its expansion, with what the next checks need."""

    spec: ExperimentSpec | None
    #: the variants (:func:`expand`; empty when ``spec`` is None)
    variants: list[PlannedVariant]
    #: the schema's problems (locations under ``body``), else the expansion's
    errors: list[dict[str, Any]]
    #: the baseline's engine arguments and each variant's ``(loc, changes)``, from the
    #: spec or, when it does not validate, from the raw document
    #: (:meth:`orchestrator.experiments.engine_catalog.EngineArgCatalog.check_spec`)
    engine_args: tuple[dict[str, Any], list[tuple[list[str | int], Any]]]
    #: ``(model, revision)`` to look up, or None when its problems would only repeat
    #: the others' (a bad revision, no model name, a spec whose expansion failed)
    model: tuple[str, str | None] | None

    @property
    def expansion(self) -> Expansion:
        return self.variants, self.errors


def read_spec(body: Any) -> SpecReading:
    """Validate spec document ``body`` (or an :class:`ExperimentSpec`) and expand it;
    every problem of the document's own rules, none raised."""
    try:
        spec = ExperimentSpec.model_validate(body)
    except ValidationError as exc:
        errors = [
            {"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in exc.errors()
        ]
        return SpecReading(None, [], errors, *_raw_reading(body, errors))
    variants, errors = expand(spec)
    at = [(v.loc, v.changes) for v in variants[1:]]
    model = None if errors else (spec.model, spec.revision)
    return SpecReading(spec, variants, errors, (spec.baseline.engine_args, at), model)


def _raw_reading(
    body: Any, errors: list[dict[str, Any]]
) -> tuple[tuple[dict[str, Any], list[tuple[list[str | int], Any]]], tuple[str, str | None] | None]:
    """The engine arguments and the model of a document that does not validate, as far as
    its shape lets them be read."""
    if not isinstance(body, dict):
        return ({}, []), None
    baseline = body.get("baseline")
    args = baseline.get("engine_args") if isinstance(baseline, dict) else None
    variants = body.get("variants")
    at: list[tuple[list[str | int], Any]] = [
        (["body", "variants", i], v.get("changes") if isinstance(v, dict) else None)
        for i, v in enumerate(variants if isinstance(variants, list) else [])
    ]
    revision_bad = any(e.get("loc", [])[:2] == ["body", "revision"] for e in errors)
    model = None
    if isinstance(body.get("model"), str) and body["model"] and not revision_bad:
        revision = body.get("revision") if isinstance(body.get("revision"), str) else None
        model = (body["model"], revision)
    return (args if isinstance(args, dict) else {}, at), model


def screen_experiment(settings: Settings, catalog: EngineArgCatalog, body: Any) -> Screened:
    """The checks that need neither the cluster nor vLLM: the document's schema, the
    spec's own rules (its expansion), its engine arguments and its model.

    Raises :class:`SpecInvalidError` (locations start with ``body``) when the document
    does not validate, the expansion fails or the model is unknown, listing every
    problem found so far (the engine arguments' among them); the engine arguments'
    problems alone are returned, to be reported with the plan's.
    """
    reading = read_spec(body)
    arg_errors = catalog.check_spec(*reading.engine_args)
    errors = [*reading.errors, *arg_errors]
    model = None
    if reading.model is not None:
        try:
            model = resolve_model(settings, *reading.model)
        except SpecInvalidError as exc:
            errors += exc.errors
    if reading.spec is None or reading.errors or model is None:
        raise SpecInvalidError(errors)
    return Screened(reading.spec, reading.expansion, arg_errors, model)


def check_experiment(
    settings: Settings,
    catalog: EngineArgCatalog,
    cluster: ClusterView,
    body: Any,
    *,
    resolver: Resolver | None = None,
) -> CheckedExperiment:
    """Every check of spec document ``body`` (or an :class:`ExperimentSpec`): the spec's
    own (:func:`screen_experiment`), then its plan against ``cluster`` and vLLM's
    answers through ``resolver`` (None: vLLM is not asked). Uses no database.

    Raises :class:`SpecInvalidError` listing every problem; 503 ``submissions_busy``
    from ``resolver``.
    """
    spec, expanded, arg_errors, model = screen_experiment(settings, catalog, body)
    request_lists = RequestLists(model.path)
    plan = plan_submission(
        spec, expanded, model, cluster, catalog, arg_errors, resolver, request_lists
    )
    if plan.errors:
        raise SpecInvalidError(plan.errors)
    return CheckedExperiment(spec, model, plan, request_lists)
