"""Experiment design: from a validated spec to the runs to execute, or every reason to refuse.

:func:`plan_experiment` checks, in order:

1. the spec's own rules (:func:`orchestrator.experiments.spec.expand`: one variable per
   variant, references, invariants, levels equal to the reference);
2. every engine argument against the installed vLLM's argument list;
3. the layout against the cluster (devices per run vs the devices the live
   orchestrators report);
4. optionally, the configuration **vLLM itself resolves** for every variant
   (``jobs/launcher/vllm_launcher.py resolve``): vLLM refusing a configuration (a
   context cap above the model's limit ...) is a 422, and a tracked field
   that vLLM derives from the changed variable (e.g. a batch-token limit
   that follows ``max_model_len``) counts as a second variable.

It then lays the runs out: each variant ``repeats`` times, interleaved
(A1 B1 A2 B2 ...), variants sharing a server configuration next to each
other so they can reuse one vLLM server.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jobs.load.workload import build_requests, longest_request_tokens
from jobs.schemas import WorkloadSpec
from orchestrator.cluster.placement import NodeInventory, shape_problem
from orchestrator.experiments.engine_catalog import EngineArgCatalog, parse_human_int
from orchestrator.experiments.spec import (
    Expansion,
    ExperimentSpec,
    PlannedVariant,
    RunConfig,
    execution_order,
    expand,
    ladder_variants,
)

#: Fields of vLLM's resolved configuration that an experiment controls. A
#: difference in one of them between a variant and its reference is a
#: variable; the field name equals the engine argument's name.
TRACKED_FIELDS = (
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "block_size",
    "cache_dtype",
    "dtype",
    "quantization",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "load_format",
    "long_prefill_token_threshold",
    "max_num_partial_prefills",
    "prefix_caching_hash_algo",
    "kv_cache_memory_bytes",
)

#: Chat template and framing tokens added around the workload's target lengths.
PROMPT_OVERHEAD_TOKENS = 32

#: ``resolve(model_dir, [explicit engine args, ...]) -> [{"ok", "config" | "error"}]``
Resolver = Callable[[str, list[dict[str, Any]]], list[dict[str, Any]]]


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


@dataclass
class Plan:
    variants: list[PlannedVariant] = field(default_factory=list)
    runs: list[PlannedRun] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    #: engine arguments the ladder pinned to the baseline's resolved values
    pinned: dict[str, Any] = field(default_factory=dict)


#: Scheduler limits vLLM scales with the world size (TP x PP): the ladder pins
#: them to the baseline's resolved values so the TP step changes TP alone.
LADDER_PINNED = ("max_num_batched_tokens", "max_num_seqs")


def pin_ladder_defaults(
    spec: ExperimentSpec, resolver: Resolver, model_dir: str, generated_model: bool
) -> tuple[ExperimentSpec, dict[str, Any]]:
    """Pin :data:`LADDER_PINNED` in the ladder's baseline to what vLLM resolves for step 1.

    vLLM 0.32 derives ``max_num_batched_tokens`` and ``max_num_seqs`` from the
    world size, so raising TP would otherwise change them too (a second
    variable). Arguments the user set are left alone. Returns (spec, pins).
    """
    base, _ = ladder_variants(spec)
    (answer,) = resolver(model_dir, [engine_args_of(base, generated_model)])
    if not answer.get("ok"):
        return spec, {}
    tracked = _tracked(answer.get("config") or {})
    pins = {
        k: tracked[k]
        for k in LADDER_PINNED
        if k not in spec.baseline.engine_args and tracked.get(k) is not None
    }
    if not pins:
        return spec, {}
    baseline = spec.baseline.model_copy(
        update={"engine_args": {**spec.baseline.engine_args, **pins}}
    )
    return spec.model_copy(update={"baseline": baseline}), pins


def engine_args_of(config: RunConfig, generated_model: bool) -> dict[str, Any]:
    """The engine arguments a run configuration passes on vLLM's command line: the one
    place they are assembled (stored as ``Run.explicit_engine_args``, asked of vLLM by the
    configuration check, launched by :mod:`orchestrator.runs.launch`)."""
    args: dict[str, Any] = {}
    if generated_model:
        args["load_format"] = (
            "dummy"  # random weights, real compute (docs/ARCHITECTURE.md: models without downloads)
        )
    args.update(config.engine_args)
    args["tensor_parallel_size"] = config.layout.tensor_parallel_size
    args["pipeline_parallel_size"] = config.layout.pipeline_parallel_size
    return args


def explicit_engine_args(variant: PlannedVariant, generated_model: bool) -> dict[str, Any]:
    """The engine arguments a variant's runs pass on vLLM's command line."""
    return engine_args_of(variant.config, generated_model)


def server_key(model_digest: str, explicit: dict[str, Any], layout: dict[str, Any]) -> str:
    """Runs with the same key can share one vLLM server (they differ only client-side)."""
    doc = json.dumps([model_digest, explicit, layout], sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()[:32]


_EXC_PREFIX = re.compile(r"\b(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception):\s*")
_SITE_PATH = re.compile(r"(?:/[^\s'\"]*)?/(?:site|dist)-packages/[^\s'\"]*")
_PYDANTIC_NOISE = re.compile(
    r"\s*\[type=[^\]]*\]|\s*For further information visit \S+|"
    r",?\s*input_value=.*?(?=, input_type=|\]|$)|,?\s*input_type=\w+"
)


def public_reason(text: str) -> str:
    """vLLM's refusal, fit for a client: without exception class names, pydantic's
    noise (input values, type tags, links) and paths inside the engine's installation;
    what the user can act on (the field and the rule) stays."""
    text = _SITE_PATH.sub("<engine installation>", text)
    text = _PYDANTIC_NOISE.sub("", text)
    text = _EXC_PREFIX.sub("", text)
    text = re.sub(r"\d+ validation errors? for \w+\s*", "", text)
    return " ".join(text.split())[:1000]


def _variant_loc(spec: ExperimentSpec, variant: PlannedVariant) -> list[str | int]:
    if variant.source == "variant":
        idx = next(i for i, v in enumerate(spec.variants) if v.name == variant.name)
        return ["body", "variants", idx]
    if variant.source == "factor":
        return ["body", "factors", variant.variable or ""]
    if variant.source == "ladder":
        return ["body", "preset", variant.name]
    return ["body", "baseline"]


def _tracked(config: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = key.rsplit(".", 1)[-1]
        if name in TRACKED_FIELDS:
            out[name] = value
    return out


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _workload_problem(workload: WorkloadSpec) -> str | None:
    """Why ``workload``'s request list cannot be built (sized without a tokenizer), or None."""
    try:
        build_requests(workload, None)
    except ValueError as exc:
        return str(exc)
    return None


def context_cap(
    v: PlannedVariant, resolved: dict[str, Any] | None, model_max_len: int | None
) -> int | None:
    """The context cap a variant really runs with: vLLM's resolved value, else an integer
    in the spec, else the model's own limit (``max_position_embeddings``). The one rule:
    the request-length check and the stored ``Run.max_model_len`` both use it."""
    if resolved and _int_or_none(resolved.get("model_config.max_model_len")):
        return int(resolved["model_config.max_model_len"])
    return parse_human_int(v.config.engine_args.get("max_model_len")) or model_max_len


def _resolved_no_change(v: PlannedVariant, mine: dict[str, Any], ref: dict[str, Any]) -> str | None:
    """When ``v`` changes engine arguments that vLLM resolves to the same values, say which."""
    if not v.variable_paths or not all(p.startswith("engine_args.") for p in v.variable_paths):
        return None
    shown = []
    for path in v.variable_paths:
        name = path.split(".", 1)[1]
        keys = [k for k in mine if k.rsplit(".", 1)[-1] == name]
        if not keys or any(mine.get(k) != ref.get(k) for k in keys):
            return None
        shown.append(f"{name}={mine[keys[0]]!r}")
    return ", ".join(shown)


def _fill_from_vllm(resolved: dict[str, Any], by_vllm: dict[str, Any] | None) -> dict[str, Any]:
    """Replace catalogue defaults of ``None`` (decided later by vLLM) with vLLM's own values."""
    if not by_vllm:
        return resolved
    values = {k.rsplit(".", 1)[-1]: v for k, v in by_vllm.items()}
    return {
        k: (values[k] if v is None and values.get(k) is not None else v)
        for k, v in resolved.items()
    }


def plan_experiment(
    spec: ExperimentSpec,
    catalog: EngineArgCatalog,
    *,
    model_dir: str,
    model_digest: str,
    generated_model: bool,
    cluster_devices: int | None = None,
    resolver: Resolver | None = None,
    model_max_len: int | None = None,
    cluster_nodes: list[NodeInventory] | None = None,
    expanded: Expansion | None = None,
) -> Plan:
    """Expand and check ``spec``; the plan's ``errors`` list every problem found.

    ``cluster_devices``: the most devices the cluster offers (None: unknown,
    not checked). ``resolver``: asks vLLM for its resolved configuration of
    each distinct argument set (None: skipped). ``model_max_len``: the
    model's own context limit, used when neither the spec nor vLLM says.
    ``cluster_nodes``: the live nodes and their devices; when given, each
    variant's TP x PP shape is checked against them
    (:func:`orchestrator.cluster.placement.shape_problem`: a TP group must fit in one
    node, PP stages split evenly over nodes). ``expanded``: :func:`expand` of ``spec``
    when the caller made it already (a submission expands its spec once); a ladder whose
    baseline vLLM pins is a new spec, expanded here.
    """
    plan = Plan()
    # vLLM is asked nothing about arguments the catalogue refuses (unknown, or naming
    # files or code the path policy does not allow): they are reported below
    if (
        spec.preset == "ladder"
        and resolver is not None
        and not catalog.check(spec.baseline.engine_args, [])
    ):
        spec, plan.pinned = pin_ladder_defaults(spec, resolver, model_dir, generated_model)
    if expanded is None or plan.pinned:
        expanded = expand(spec)
    variants, errors = expanded[0], list(expanded[1])
    plan.variants = variants
    errors += catalog.check(spec.baseline.engine_args, ["body", "baseline", "engine_args"])
    for v in variants[1:]:
        for path, value in v.changes.items():
            if path.startswith("engine_args."):
                name = path.split(".", 1)[1]
                for err in catalog.check({name: value}, []):
                    errors.append({**err, "loc": [*_variant_loc(spec, v), "changes", path]})
    if cluster_nodes:
        for v in variants:
            lay = v.config.layout
            problem = shape_problem(
                cluster_nodes, lay.tensor_parallel_size, lay.pipeline_parallel_size, lay.reserved
            )
            if problem is not None:
                errors.append(
                    {
                        "loc": [*_variant_loc(spec, v), "layout"],
                        "msg": f"{v.name}: {problem}",
                        "type": "cluster_too_small",
                    }
                )
    elif cluster_devices is not None:
        for v in variants:
            need = v.config.layout.reserved
            if need > cluster_devices:
                errors.append(
                    {
                        "loc": [*_variant_loc(spec, v), "layout"],
                        "msg": f"{v.name} needs {need} devices; the cluster has {cluster_devices}",
                        "type": "cluster_too_small",
                    }
                )
    if errors:
        plan.errors = errors
        return plan

    explicit = {v.name: explicit_engine_args(v, generated_model) for v in variants}
    flagged: set[str] = set()  # variants already refused (one reason each is enough)
    resolved_by_vllm: dict[str, dict[str, Any]] = {}
    if resolver is not None:
        distinct = list({json.dumps(a, sort_keys=True): a for a in explicit.values()}.values())
        answers = resolver(model_dir, distinct)
        by_key = {json.dumps(a, sort_keys=True): r for a, r in zip(distinct, answers, strict=True)}
        for v in variants:
            answer = by_key[json.dumps(explicit[v.name], sort_keys=True)]
            if not answer.get("ok"):
                errors.append(
                    {
                        "loc": _variant_loc(spec, v),
                        "msg": f"vLLM refuses the configuration of {v.name!r}: "
                        f"{public_reason(str(answer.get('error', 'unknown error')))}",
                        "type": "engine_refuses_config",
                    }
                )
            else:
                resolved_by_vllm[v.name] = dict(answer.get("config") or {})
        by_name = {v.name: v for v in variants}
        for v in variants[1:]:
            if v.name not in resolved_by_vllm or v.reference not in resolved_by_vllm:
                continue
            mine = _tracked(resolved_by_vllm[v.name])
            ref = _tracked(resolved_by_vllm[str(v.reference)])
            changed_names = {p.rsplit(".", 1)[-1] for p in v.variable_paths}
            extra = {
                k: (ref.get(k), mine.get(k))
                for k in sorted(set(mine) | set(ref))
                if mine.get(k) != ref.get(k) and k not in changed_names
            }
            if extra:
                errors.append(
                    {
                        "loc": _variant_loc(spec, v),
                        "msg": f"with {v.variable} changed, vLLM also resolves "
                        + "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in extra.items())
                        + f" vs {by_name[str(v.reference)].name!r}: that is more than one "
                        "variable. Pin those arguments in the baseline, or declare a linked "
                        "factor that sets them together",
                        "type": "derived_default_changes",
                        "variables": {k: list(ab) for k, ab in extra.items()},
                    }
                )
        for v in variants[1:]:
            if v.name not in resolved_by_vllm or v.reference not in resolved_by_vllm:
                continue
            same = _resolved_no_change(
                v, resolved_by_vllm[v.name], resolved_by_vllm[str(v.reference)]
            )
            if same:
                flagged.add(v.name)
                errors.append(
                    {
                        "loc": _variant_loc(spec, v),
                        "msg": f"{v.name!r} changes nothing vLLM would run differently: "
                        f"it resolves {same} the same as {v.reference!r}",
                        "type": "no_change",
                    }
                )
    seen: dict[str, str] = {}
    for v in variants:
        identity = json.dumps(
            [
                resolved_by_vllm.get(v.name) or explicit[v.name],
                v.config.layout.model_dump(mode="json"),
                v.config.workload.model_dump(mode="json"),
            ],
            sort_keys=True,
            default=str,
        )
        if identity in seen and v.name not in flagged:
            errors.append(
                {
                    "loc": _variant_loc(spec, v),
                    "msg": f"{v.name!r} runs exactly the same configuration as {seen[identity]!r}",
                    "type": "duplicate_variant",
                }
            )
        seen.setdefault(identity, v.name)
    workload_problems: dict[str, str | None] = {}
    caps: dict[str, int | None] = {}
    for v in variants:
        w = v.config.workload
        key = w.model_dump_json()
        if key not in workload_problems:
            workload_problems[key] = _workload_problem(w)
        if workload_problems[key] is not None:
            errors.append(
                {
                    "loc": [*_variant_loc(spec, v), "workload"],
                    "msg": f"{v.name}: {workload_problems[key]}",
                    "type": "workload_invalid",
                }
            )
            continue
        cap = caps[v.name] = context_cap(v, resolved_by_vllm.get(v.name), model_max_len)
        longest = longest_request_tokens(w) + PROMPT_OVERHEAD_TOKENS
        if cap is not None and longest > cap:
            errors.append(
                {
                    "loc": [*_variant_loc(spec, v), "workload"],
                    "msg": f"{v.name}: the longest request needs about {longest} tokens "
                    f"(prompt and output), above max_model_len {cap}",
                    "type": "request_exceeds_context_cap",
                }
            )
    if errors:
        plan.errors = errors
        return plan

    keys = {
        v.name: server_key(model_digest, explicit[v.name], v.config.layout.model_dump(mode="json"))
        for v in variants
    }
    by_name = {v.name: v for v in variants}
    for seq, (name, rep) in enumerate(execution_order(variants, spec.repeats, keys)):
        v = by_name[name]
        plan.runs.append(
            PlannedRun(
                variant=v,
                repeat_index=rep,
                sequence=seq,
                explicit_engine_args=explicit[name],
                resolved_engine_args={
                    **_fill_from_vllm(catalog.resolve(explicit[name]), resolved_by_vllm.get(name)),
                    "model": model_dir,
                },
                server_key=keys[name],
                resolved_config=resolved_by_vllm.get(name),
                max_model_len=caps[name],
            )
        )
    return plan
