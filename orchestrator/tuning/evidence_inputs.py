"""What the tuning service gathers for the order hook (:mod:`orchestrator.tuning.evidence`)
and keeps of its answers: the hook's inputs read from the database, the model directory
and the live cluster (:func:`gather_evidence`), and each round's answer kept with the
campaign (:class:`RoundOrders`) so a replay never reorders a round already opened.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from orchestrator.analysis.advisor import run_findings
from orchestrator.analysis.kvcache.memory import weights_gib
from orchestrator.campaigns.outcomes import OrderHook, Triage
from orchestrator.campaigns.space import Candidate, Config, ConfigKey, Level, config_key
from orchestrator.core.db import is_unavailable
from orchestrator.core.models import Run
from orchestrator.core.repositories import RunRepository
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus, is_terminal
from orchestrator.experiments.cluster_view import ClusterView
from orchestrator.experiments.model_resolution import resolve_model
from orchestrator.tuning.campaign_request import CampaignRequest
from orchestrator.tuning.evidence import Devices, Evidence, ModelFacts, RunFacts, order_by_evidence

log = logging.getLogger(__name__)


# ----------------------------------------------------------------- kept per round


class RoundOrders:
    """Each round's answer, kept with the campaign (``result["order"]``) so a replay gives
    the same one whatever the live facts say later: ``hook(evidence)`` answers a round it
    has kept from what it kept, and a new one from ``evidence()`` (called once, when
    first needed), keeping the answer. ``kept`` is JSON: ``{key: [[label, skip], ...]}``."""

    def __init__(self, kept: Mapping[str, Any] | None = None) -> None:
        self.kept: dict[str, list[list[str | None]]] = {
            str(k): [list(t) for t in v] for k, v in (kept or {}).items() if isinstance(v, list)
        }

    @staticmethod
    def key(incumbent: Config, candidates: Sequence[Candidate]) -> str:
        return json.dumps(
            [[list(k) for k in config_key(incumbent)], sorted(c.label for c in candidates)],
            default=str,
        )

    def hook(self, evidence: Callable[[], Evidence]) -> OrderHook:
        got: list[OrderHook] = []

        def order(incumbent: Config, candidates: Sequence[Candidate]) -> list[Triage]:
            key = self.key(incumbent, candidates)
            by_label = {c.label: c for c in candidates}
            kept = self.kept.get(key)
            if kept is not None and sorted(str(t[0]) for t in kept) == sorted(by_label):
                return [Triage(by_label[str(t[0])], t[1]) for t in kept]
            try:
                if not got:
                    got.append(order_by_evidence(evidence()))
                answer = list(got[0](incumbent, candidates))
            except Exception as exc:  # evidence is advice: without it, the space's order
                if is_unavailable(exc):
                    raise
                log.warning("no evidence to order the candidates of %s: %s", key, exc)
                answer = [Triage(c) for c in candidates]
            self.kept[key] = [[t.candidate.label, t.skip] for t in answer]
            return answer

        return order


# ----------------------------------------------------------------- the service's side


def gather_evidence(
    session: Session, settings: Settings, request: CampaignRequest, runs: Sequence[Run]
) -> Evidence:
    """The hook's inputs for a campaign: the model (a run's ``model_path``, else the model
    resolved as a submission resolves it; none when it cannot be), the live cluster's
    devices, and every finished run of the campaign by configuration with its metrics and
    the advisor's findings."""
    model_dir = next((Path(r.model_path) for r in runs if r.model_path), None)
    if model_dir is None or not model_dir.is_dir():
        try:
            model_dir = resolve_model(settings, request.model, request.revision).path
        except Exception:  # no model facts: the rules that need them say nothing
            model_dir = None
    config: dict[str, Any] | None = None
    weights = None
    if model_dir is not None:
        try:
            config = json.loads((model_dir / "config.json").read_text())
            weights = weights_gib(model_dir, 1)
        except (OSError, ValueError):
            config = None
    view = ClusterView.read(session, settings)
    kind = view.kind
    recorded = RunRepository(session).newest_gpu_memory() if (kind or "").upper() == "GPU" else None
    devices = Devices(
        kind=kind,
        count=view.devices,
        memory_gib=recorded[1] / 1024 if recorded else None,
        memory_from=f"as run {recorded[0]} recorded its GPUs" if recorded else None,
        kv_cache_gib=float(settings.engine.kv_cache_space_gib)
        if (kind or "").upper() == "CPU"
        else None,
        per_node=max((n.total for n in view.nodes or [] if n.alive), default=None),
    )
    return Evidence(
        baseline=request.baseline,
        latency_objective=request.objective.metric.endswith("_ms"),
        model=ModelFacts(model_dir=model_dir, config=config, weights_gib=weights),
        devices=devices,
        runs=_run_facts(session, request, runs),
    )


def _run_facts(
    session: Session, request: CampaignRequest, runs: Sequence[Run]
) -> dict[ConfigKey, list[RunFacts]]:
    ended = [
        r
        for r in runs
        if is_terminal(r.status) and r.status in (RunStatus.SUCCEEDED.value, RunStatus.FAILED.value)
    ]
    metrics = RunRepository(session).metrics_for([r.id for r in ended])
    out: dict[ConfigKey, list[RunFacts]] = {}
    for run in ended:
        config = run_config(request, run)
        if config is None:
            continue
        info = run.engine_info or {}
        doc = {
            "id": run.id,
            "status": run.status,
            "error": run.error,
            "engine_args": run.engine_args,
            "engine_info": info,
        }
        printed = (info.get("startup_facts") or {}).get("available_kv_cache_memory_gib")
        out.setdefault(config_key(config), []).append(
            RunFacts(
                metrics=metrics.get(run.id, {}),
                findings=tuple(run_findings(doc, metrics.get(run.id, {}))),
                kv_cache_gib=float(printed) if isinstance(printed, int | float) else None,
            )
        )
    return out


def run_config(request: CampaignRequest, run: Run) -> dict[str, Level] | None:
    """The space's variables as ``run`` set them (None when one is missing)."""
    sections = {
        "engine_args": run.explicit_engine_args or {},
        "layout": run.layout or {},
        "workload": run.workload or {},
    }
    config: dict[str, Level] = {}
    for v in request.variables():
        section, name = v.name.split(".", 1)
        value = sections.get(section, {}).get(name)
        if not isinstance(value, bool | int | float | str):
            return None
        config[v.name] = value
    return config
