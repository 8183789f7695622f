"""The runs of a checked plan, laid out: each variant ``repeats`` times, interleaved
(A1 B1 A2 B2 ...), variants sharing a server configuration next to each other so they
can reuse one vLLM server (:func:`execution_order`, :func:`server_key`).

The last step of :func:`orchestrator.experiments.planner.plan_experiment`, once every
check passed; :class:`PlannedRun` is what :mod:`orchestrator.experiments.service` stores.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from orchestrator.experiments.engine_catalog import EngineArgCatalog
from orchestrator.experiments.spec import ExperimentSpec, PlannedVariant


@dataclass
class PlannedRun:
    variant: PlannedVariant
    repeat_index: int
    sequence: int
    explicit_engine_args: dict[str, Any]
    resolved_engine_args: dict[str, Any]
    server_key: str
    resolved_config: dict[str, Any] | None = None
    #: the context cap the run really runs with (:func:`context_cap`)
    max_model_len: int | None = None


def server_key(model_digest: str, explicit: dict[str, Any], layout: dict[str, Any]) -> str:
    """Runs with the same key can share one vLLM server (they differ only client-side)."""
    doc = json.dumps([model_digest, explicit, layout], sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()[:32]


def fill_from_vllm(resolved: dict[str, Any], by_vllm: dict[str, Any] | None) -> dict[str, Any]:
    """Replace catalogue defaults of ``None`` (decided later by vLLM) with vLLM's own values."""
    if not by_vllm:
        return resolved
    values = {k.rsplit(".", 1)[-1]: v for k, v in by_vllm.items()}
    return {
        k: (values[k] if v is None and values.get(k) is not None else v)
        for k, v in resolved.items()
    }


def lay_out(
    spec: ExperimentSpec,
    variants: list[PlannedVariant],
    explicit: dict[str, dict[str, Any]],
    resolved: dict[str, dict[str, Any]],
    caps: dict[str, int | None],
    catalog: EngineArgCatalog,
    model_dir: str,
    model_digest: str,
) -> list[PlannedRun]:
    """The runs of a plan that passed every check, in :func:`execution_order`."""
    keys = {
        v.name: server_key(model_digest, explicit[v.name], v.config.layout.model_dump(mode="json"))
        for v in variants
    }
    by_name = {v.name: v for v in variants}
    return [
        PlannedRun(
            variant=by_name[name],
            repeat_index=rep,
            sequence=seq,
            explicit_engine_args=explicit[name],
            resolved_engine_args={
                **fill_from_vllm(catalog.resolve(explicit[name]), resolved.get(name)),
                "model": model_dir,
            },
            server_key=keys[name],
            resolved_config=resolved.get(name),
            max_model_len=caps[name],
        )
        for seq, (name, rep) in enumerate(execution_order(variants, spec.repeats, keys))
    ]


def execution_order(
    variants: list[PlannedVariant], repeats: int, server_key: dict[str, str] | None = None
) -> list[tuple[str, int]]:
    """Interleaved order of (variant name, repeat index): A1 B1 C1 A2 B2 C2 ...

    Within a round, variants that share a server configuration
    (``server_key``: variant -> key) are placed next to each other (stable,
    by first appearance) so one vLLM server can serve them in turn.
    """
    names = [v.name for v in variants]
    if server_key:
        first: dict[str, int] = {}
        for i, n in enumerate(names):
            first.setdefault(server_key[n], i)
        names = sorted(names, key=lambda n: (first[server_key[n]], names.index(n)))
    return [(n, r) for r in range(repeats) for n in names]
