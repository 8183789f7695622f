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

5. each workload's request list (:class:`RequestLists`) and its longest request against
   the context cap.

It then lays the runs out (:mod:`orchestrator.experiments.run_layout`).

Size: about 610 lines of one responsibility, the checks a plan passes in the order
vLLM's answers allow; the vLLM-answer checks split into a module of their own would
send a submission from here there and back again (the walk of ``POST /experiments``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.load.workload import build_requests, longest_request_tokens, request_list_hash
from jobs.modelgen.generator import load_tokenizer
from jobs.schemas import WorkloadSpec
from orchestrator.cluster.placement import RAY_EXECUTOR_ON_CPU, NodeInventory, shape_problem
from orchestrator.experiments.cluster_view import ClusterView
from orchestrator.experiments.engine_catalog import EngineArgCatalog, parse_human_int
from orchestrator.experiments.run_layout import PlannedRun, lay_out
from orchestrator.experiments.spec import (
    Expansion,
    ExperimentSpec,
    PlannedVariant,
    RunConfig,
    expand,
)

if TYPE_CHECKING:  # model_resolution -> config_check -> this module (for Resolver)
    from orchestrator.experiments.model_resolution import ResolvedModel

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
    spec: ExperimentSpec,
    base: RunConfig,
    resolver: Resolver,
    model_dir: str,
    generated_model: bool,
) -> tuple[ExperimentSpec, dict[str, Any]]:
    """Pin :data:`LADDER_PINNED` in the ladder's baseline to what vLLM resolves for step 1.

    vLLM 0.32 derives ``max_num_batched_tokens`` and ``max_num_seqs`` from the
    world size, so raising TP would otherwise change them too (a second
    variable). Arguments the user set are left alone. ``base``: step 1's configuration
    (the first variant of the ladder's expansion). Returns (spec, pins).
    """
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


def _tracked(config: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = key.rsplit(".", 1)[-1]
        if name in TRACKED_FIELDS:
            out[name] = value
    return out


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class RequestLists:
    """The request lists of a submission's workloads: each distinct workload built once,
    with the model's tokenizer (loaded on first use), by
    :func:`jobs.load.workload.build_requests` (the one builder, also the runner's): why it
    cannot be built (:meth:`problem`), else its hash (:meth:`hash`, stored with the runs).
    ``model_path`` None sizes the texts without a tokenizer (4 characters a token)."""

    def __init__(self, model_path: Path | None) -> None:
        self.model_path = model_path
        self._tokenizer: Any = None
        self._built: dict[str, tuple[str | None, str | None]] = {}

    def _build(self, workload: WorkloadSpec) -> tuple[str | None, str | None]:
        key = workload.model_dump_json()
        if key not in self._built:
            if self._tokenizer is None and self.model_path is not None:
                self._tokenizer = load_tokenizer(self.model_path)
            try:
                requests = build_requests(workload, self._tokenizer)
            except ValueError as exc:
                self._built[key] = (str(exc), None)
            else:
                self._built[key] = (None, request_list_hash(requests))
        return self._built[key]

    def problem(self, workload: WorkloadSpec) -> str | None:
        """Why ``workload``'s request list cannot be built, or None."""
        return self._build(workload)[0]

    def hash(self, workload: WorkloadSpec) -> str:
        """The hash of ``workload``'s request list (:func:`request_list_hash`)."""
        digest = self._build(workload)[1]
        if digest is None:
            raise ValueError(self.problem(workload))
        return digest


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


def plan_submission(
    spec: ExperimentSpec,
    expanded: Expansion,
    model: ResolvedModel,
    cluster: ClusterView,
    catalog: EngineArgCatalog,
    arg_errors: list[dict[str, Any]],
    resolver: Resolver | None,
    request_lists: RequestLists,
) -> Plan:
    """:func:`plan_experiment` for a submission: ``spec`` (``expanded``: its :func:`expand`,
    ``arg_errors``: its engine arguments' problems) on ``model``, checked against
    ``cluster``, after what makes vLLM's check pointless:

    - weights the node cannot load (an offline Hugging Face cache without them) for a
      variant that does not use dummy weights;
    - a variant with ``layout.executor: "ray"`` when the device kind in force is CPU
      (the CPU build of vLLM refuses the Ray executor).

    Uses no database.
    """
    variants = expanded[0]
    if model.resolution.get("offline") and model.resolution.get("weights_cached") is False:
        missing = [v.name for v in variants if v.config.engine_args.get("load_format") != "dummy"]
        if missing:
            return Plan(variants=variants, errors=[_weights_missing(model, missing)])
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
    return _plan(
        spec,
        catalog,
        expanded,
        arg_errors,
        model_dir=str(model.path),
        model_digest=model.digest,
        generated_model=model.generated,
        cluster_devices=cluster.devices,
        resolver=resolver,
        model_max_len=model.max_position_embeddings,
        cluster_nodes=cluster.nodes,
        request_lists=request_lists,
    )


def _weights_missing(model: ResolvedModel, missing: list[str]) -> dict[str, Any]:
    return {
        "loc": ["body", "model"],
        "msg": f"{model.model_id} @ {model.revision}: the node's Hugging Face "
        f"cache ({model.resolution.get('hf_cache')}) has its config and "
        "tokenizer but no weights, and HF_HUB_OFFLINE=1 there, so vLLM cannot "
        "load it; download the weights into that cache, or set "
        "engine_args.load_format 'dummy' (random weights) for: "
        f"{', '.join(missing)}",
        "type": "model_weights_missing",
    }


def _executor_loc(spec: ExperimentSpec, v: PlannedVariant) -> list[str | int]:
    """Where a variant's ``layout.executor`` comes from in the submitted document."""
    if v.source == "variant" and "layout.executor" in v.changes:
        index = next(i for i, x in enumerate(spec.variants) if x.name == v.name)
        return ["body", "variants", index, "changes", "layout.executor"]
    if v.source == "factor":
        return ["body", "factors", v.variable or ""]
    return ["body", "baseline", "layout", "executor"]


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
    arg_errors: list[dict[str, Any]] | None = None,
    request_lists: RequestLists | None = None,
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
    baseline vLLM pins is a new spec, expanded here. ``arg_errors``: the problems of the
    spec's engine arguments (:meth:`EngineArgCatalog.check_spec`) when the caller found
    them already. ``request_lists``: the workloads' request lists (sized without a
    tokenizer when None).
    """
    if expanded is None:
        expanded = expand(spec)
    if arg_errors is None:
        arg_errors = catalog.check_spec(spec.baseline.engine_args, changes_at(expanded[0]))
    return _plan(
        spec,
        catalog,
        expanded,
        arg_errors,
        model_dir=model_dir,
        model_digest=model_digest,
        generated_model=generated_model,
        cluster_devices=cluster_devices,
        resolver=resolver,
        model_max_len=model_max_len,
        cluster_nodes=cluster_nodes,
        request_lists=request_lists or RequestLists(None),
    )


def _plan(
    spec: ExperimentSpec,
    catalog: EngineArgCatalog,
    expanded: Expansion,
    arg_errors: list[dict[str, Any]],
    *,
    model_dir: str,
    model_digest: str,
    generated_model: bool,
    cluster_devices: int | None,
    resolver: Resolver | None,
    model_max_len: int | None,
    cluster_nodes: list[NodeInventory] | None,
    request_lists: RequestLists,
) -> Plan:
    """:func:`plan_experiment` once the spec is expanded and its engine arguments checked."""
    plan = Plan()
    # vLLM is asked nothing about arguments the catalogue refuses (unknown, or naming
    # files or code the path policy does not allow): they are reported below
    baseline_ok = not any(e["loc"][:3] == ["body", "baseline", "engine_args"] for e in arg_errors)
    if spec.preset == "ladder" and resolver is not None and baseline_ok:
        base = expanded[0][0].config
        spec, plan.pinned = pin_ladder_defaults(spec, base, resolver, model_dir, generated_model)
        if plan.pinned:
            expanded = expand(spec)
    plan.variants = variants = expanded[0]
    errors = [
        *expanded[1],
        *arg_errors,
        *_cluster_errors(spec, variants, cluster_nodes, cluster_devices),
    ]
    if errors:
        plan.errors = errors
        return plan
    explicit = {v.name: explicit_engine_args(v, generated_model) for v in variants}
    resolved: dict[str, dict[str, Any]] = {}
    flagged: set[str] = set()  # variants already refused (one reason each is enough)
    if resolver is not None:
        resolved, errors = _ask_vllm(
            spec, variants, explicit, resolver(model_dir, _distinct(explicit))
        )
        errors += _derived_changes(spec, variants, resolved)
        errors += _no_changes(spec, variants, resolved, flagged)
    errors += _duplicates(spec, variants, explicit, resolved, flagged)
    caps, problems = _workload_errors(spec, variants, resolved, model_max_len, request_lists)
    if errors or problems:
        plan.errors = errors + problems
        return plan
    plan.runs = lay_out(spec, variants, explicit, resolved, caps, catalog, model_dir, model_digest)
    return plan


def changes_at(variants: list[PlannedVariant]) -> list[tuple[list[str | int], Any]]:
    """``(loc, changes)`` of each variant but the baseline, for
    :meth:`EngineArgCatalog.check_spec`."""
    return [(v.loc, v.changes) for v in variants[1:]]


def _cluster_errors(
    spec: ExperimentSpec,
    variants: list[PlannedVariant],
    cluster_nodes: list[NodeInventory] | None,
    cluster_devices: int | None,
) -> list[dict[str, Any]]:
    """Each variant whose layout the cluster cannot hold: its TP x PP shape on the live
    nodes when known, else its device count against the most the cluster offers."""
    errors: list[dict[str, Any]] = []
    for v in variants:
        lay = v.config.layout
        if cluster_nodes:
            problem = shape_problem(
                cluster_nodes, lay.tensor_parallel_size, lay.pipeline_parallel_size, lay.reserved
            )
            msg = f"{v.name}: {problem}" if problem is not None else None
        elif cluster_devices is not None and lay.reserved > cluster_devices:
            msg = f"{v.name} needs {lay.reserved} devices; the cluster has {cluster_devices}"
        else:
            msg = None
        if msg is not None:
            loc = [*v.loc, "layout"]
            errors.append({"loc": loc, "msg": msg, "type": "cluster_too_small"})
    return errors


def _distinct(explicit: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each distinct argument set of ``explicit`` once (what vLLM is asked)."""
    return list({json.dumps(a, sort_keys=True): a for a in explicit.values()}.values())


def _ask_vllm(
    spec: ExperimentSpec,
    variants: list[PlannedVariant],
    explicit: dict[str, dict[str, Any]],
    answers: list[dict[str, Any]],
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """vLLM's resolved configuration of each variant (``answers``: of :func:`_distinct`),
    and a refusal for each variant whose configuration vLLM refuses."""
    distinct = _distinct(explicit)
    by_key = {json.dumps(a, sort_keys=True): r for a, r in zip(distinct, answers, strict=True)}
    resolved: dict[str, dict[str, Any]] = {}
    errors: list[dict[str, Any]] = []
    for v in variants:
        answer = by_key[json.dumps(explicit[v.name], sort_keys=True)]
        if not answer.get("ok"):
            errors.append(
                {
                    "loc": [*v.loc],
                    "msg": f"vLLM refuses the configuration of {v.name!r}: "
                    f"{public_reason(str(answer.get('error', 'unknown error')))}",
                    "type": "engine_refuses_config",
                }
            )
        else:
            resolved[v.name] = dict(answer.get("config") or {})
    return resolved, errors


def _pairs(
    variants: list[PlannedVariant], resolved: dict[str, dict[str, Any]]
) -> list[tuple[PlannedVariant, dict[str, Any], dict[str, Any]]]:
    """``(variant, its resolved config, its reference's)`` where vLLM resolved both."""
    return [
        (v, resolved[v.name], resolved[str(v.reference)])
        for v in variants[1:]
        if v.name in resolved and v.reference in resolved
    ]


#: What a derived change's refusal tells the user to do.
LINKED_FACTOR_REMEDY = (
    "Pin those arguments in the baseline, or declare a linked factor that sets them together"
)


def _derived_changes(
    spec: ExperimentSpec, variants: list[PlannedVariant], resolved: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """A variant whose change makes vLLM resolve another tracked field differently too
    (a second variable)."""
    errors: list[dict[str, Any]] = []
    for v, mine_all, ref_all in _pairs(variants, resolved):
        mine, ref = _tracked(mine_all), _tracked(ref_all)
        changed_names = {p.rsplit(".", 1)[-1] for p in v.variable_paths}
        extra = {
            k: (ref.get(k), mine.get(k))
            for k in sorted(set(mine) | set(ref))
            if mine.get(k) != ref.get(k) and k not in changed_names
        }
        if extra:
            errors.append(
                {
                    "loc": [*v.loc],
                    "msg": f"with {v.variable} changed, vLLM also resolves "
                    + "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in extra.items())
                    + f" vs {str(v.reference)!r}: that is more than one variable. "
                    + LINKED_FACTOR_REMEDY,
                    "type": "derived_default_changes",
                    "variables": {k: list(ab) for k, ab in extra.items()},
                }
            )
    return errors


def _no_changes(
    spec: ExperimentSpec,
    variants: list[PlannedVariant],
    resolved: dict[str, dict[str, Any]],
    flagged: set[str],
) -> list[dict[str, Any]]:
    """A variant whose changed engine arguments vLLM resolves to its reference's values
    (added to ``flagged``)."""
    errors: list[dict[str, Any]] = []
    for v, mine, ref in _pairs(variants, resolved):
        same = _resolved_no_change(v, mine, ref)
        if same:
            flagged.add(v.name)
            errors.append(
                {
                    "loc": [*v.loc],
                    "msg": f"{v.name!r} changes nothing vLLM would run differently: "
                    f"it resolves {same} the same as {v.reference!r}",
                    "type": "no_change",
                }
            )
    return errors


def _duplicates(
    spec: ExperimentSpec,
    variants: list[PlannedVariant],
    explicit: dict[str, dict[str, Any]],
    resolved: dict[str, dict[str, Any]],
    flagged: set[str],
) -> list[dict[str, Any]]:
    """A variant (not ``flagged`` already) that runs exactly an earlier one's configuration."""
    errors: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for v in variants:
        identity = json.dumps(
            [
                resolved.get(v.name) or explicit[v.name],
                v.config.layout.model_dump(mode="json"),
                v.config.workload.model_dump(mode="json"),
            ],
            sort_keys=True,
            default=str,
        )
        if identity in seen and v.name not in flagged:
            errors.append(
                {
                    "loc": [*v.loc],
                    "msg": f"{v.name!r} runs exactly the same configuration as {seen[identity]!r}",
                    "type": "duplicate_variant",
                }
            )
        seen.setdefault(identity, v.name)
    return errors


def _workload_errors(
    spec: ExperimentSpec,
    variants: list[PlannedVariant],
    resolved: dict[str, dict[str, Any]],
    model_max_len: int | None,
    request_lists: RequestLists,
) -> tuple[dict[str, int | None], list[dict[str, Any]]]:
    """Each variant's context cap (:func:`context_cap`), and the variants whose request
    list cannot be built or whose longest request exceeds that cap."""
    caps: dict[str, int | None] = {}
    errors: list[dict[str, Any]] = []
    for v in variants:
        w, loc = v.config.workload, [*v.loc, "workload"]
        problem = request_lists.problem(w)
        if problem is not None:
            errors.append({"loc": loc, "msg": f"{v.name}: {problem}", "type": "workload_invalid"})
            continue
        cap = caps[v.name] = context_cap(v, resolved.get(v.name), model_max_len)
        longest = longest_request_tokens(w) + PROMPT_OVERHEAD_TOKENS
        if cap is not None and longest > cap:
            errors.append(
                {
                    "loc": loc,
                    "msg": f"{v.name}: the longest request needs about {longest} tokens "
                    f"(prompt and output), above max_model_len {cap}",
                    "type": "request_exceeds_context_cap",
                }
            )
    return caps, errors
