"""Submissions as the API takes them: one call per request.

Each waits for a check slot (back-pressure: 503 ``submissions_busy``,
:func:`orchestrator.experiments.config_check.gate_for`) with no database connection
held, then checks (:func:`orchestrator.experiments.submission.check_experiment`, no
connection held) and stores (:mod:`orchestrator.experiments.service`). The caller's unit
of work commits.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from orchestrator.core.db import release_connection
from orchestrator.core.errors import SpecInvalidError
from orchestrator.core.models import Experiment, Run
from orchestrator.core.settings import Settings
from orchestrator.experiments.cluster_view import ClusterView
from orchestrator.experiments.config_check import engine_resolver, gate_for
from orchestrator.experiments.engine_catalog import load_catalog
from orchestrator.experiments.service import store_experiment, submit_variant
from orchestrator.experiments.spec import Variant
from orchestrator.experiments.submission import check_experiment


def accept_experiment(session: Session, settings: Settings, body: Any) -> Experiment:
    """Check spec document ``body`` and store the experiment with its runs queued.

    422 ``spec_invalid`` names every bad field at once (nothing stored); 503
    ``engine_unavailable`` when the engine environment cannot list its arguments.
    No database connection is held while waiting for a slot or while vLLM checks.
    """
    release_connection(session)  # nothing held while waiting for a slot or for vLLM
    with gate_for(settings).slot():
        catalog = load_catalog(settings)
        cluster = ClusterView.read(session, settings)
        release_connection(session)  # the check holds no connection (6-80 s cold)
        checked = check_experiment(
            settings, catalog, cluster, body, resolver=engine_resolver(settings)
        )
        return store_experiment(session, checked, catalog)


def accept_variant(
    session: Session, settings: Settings, run_id: str, name: str, changes: dict[str, Any]
) -> list[Run]:
    """Clone run ``run_id``'s variant as ``name`` with ``changes`` (exactly one change);
    its repeats are queued after the experiment's. 422 under the rules of a new
    experiment."""
    try:
        variant = Variant(name=name, changes=changes)
    except ValidationError as exc:
        raise SpecInvalidError.from_validation(exc) from exc
    release_connection(session)
    with gate_for(settings).slot():
        catalog = load_catalog(settings)
        return submit_variant(
            session, settings, catalog, run_id, variant, resolver=engine_resolver(settings)
        )
