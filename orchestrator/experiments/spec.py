"""The experiment spec and the one-variable-at-a-time rules.

An experiment is a **baseline** configuration plus **variants**. Variants come
from three places, in this order:

1. ``preset: "ladder"``: the tuning ladder (see :func:`ladder_variants`);
2. ``factors``: each factor is one variable (one dotted path, or several paths
   that move together: a *linked factor*) with one or more levels; every level
   becomes a variant whose reference is the baseline;
3. explicit ``variants``: ``{"name", "changes", "reference"}``; ``changes``
   maps dotted paths (``engine_args.enable_prefix_caching``,
   ``layout.tensor_parallel_size``, ``workload.concurrency``) to new values,
   applied on top of the reference (default: the baseline).

Every variant must differ from its reference in exactly one variable. A
variable is one path, or the set of paths of one declared linked factor
(``factors[].paths`` with more than one path; its ``invariant`` is checked:
``constant_product`` keeps the product of the values, e.g. TP x PP;
``equal_values`` keeps them equal, e.g. a context cap and its batch-token
limit). The check here compares the *validated* documents (pydantic defaults
applied); :mod:`orchestrator.experiments.planner` repeats it on the configuration vLLM
itself resolves, so derived defaults are caught too.

Each variant runs ``repeats`` times; repeats are interleaved
(A1 B1 C1 A2 B2 C2 ...), see :func:`orchestrator.experiments.run_layout.execution_order`.

``capacity`` (a :class:`jobs.capacity.search.CapacitySpec`) makes every run of the experiment
a capacity search under SLOs: a measurement setting like the goodput ``slos``, the same
for every run (the ladder's levels included), never a variable: a factor or variant
cannot change it, nor the workload field the search drives, and its steps must be able
to reach a steady state (:mod:`orchestrator.experiments.capacity_spec`).

Size: about 670 lines: the document's models and the one-variable rules that expand it
call each other (``Factor.changes_for``, :func:`set_path`, :func:`apply_changes`); in two
modules a submission would go back and forth between them. The reading of a raw
submitted document is :mod:`orchestrator.experiments.submission`'s.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from jobs.capacity.search import CapacitySpec
from jobs.schemas import WorkloadSpec
from orchestrator.cluster.placement import reserved_devices
from orchestrator.experiments.capacity_spec import capacity_errors, capacity_spec_problems
from orchestrator.experiments.pathpolicy import MAX_MODEL_CHARS

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.=:,\- ]{0,99}$"
SECTIONS = ("engine_args", "layout", "workload")
#: Engine arguments that mirror ``layout`` (set there, never in engine_args).
LAYOUT_ARGS = ("tensor_parallel_size", "pipeline_parallel_size")


#: The JSON schema of a ``changes`` object: its keys are dotted paths into a run
#: configuration (``engine_args.max_model_len``); the validator says which part is wrong.
CHANGES_SCHEMA: dict[str, Any] = {
    "propertyNames": {"pattern": r"^(engine_args|layout|workload)\.[A-Za-z0-9_.-]*[A-Za-z0-9_-]$"}
}


def _check_path(path: str) -> str:
    head = path.split(".", 1)[0]
    if head in ("capacity", "slos"):
        raise ValueError(
            f"path {path!r}: {head!r} is a measurement setting of the whole experiment, the "
            "same for every run; a variant or factor cannot change it"
        )
    if head not in SECTIONS or "." not in path or path.endswith("."):
        raise ValueError(
            f"path {path!r} must be <section>.<name> with section one of {', '.join(SECTIONS)}"
        )
    return path


class Layout(BaseModel):
    """Parallel layout: TP x PP ranks on ``devices`` devices (GPUs; cores on a CPU host).

    ``devices`` (default TP x PP) is what the run reserves; holding it
    constant while TP changes is the ladder's "same total GPU count" step.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    tensor_parallel_size: int = Field(1, ge=1, le=1024)
    pipeline_parallel_size: int = Field(1, ge=1, le=1024)
    devices: int | None = Field(None, ge=1, le=4096, description="devices reserved; >= TP x PP")
    exclusive_nodes: bool = Field(
        False, description="keep the run alone on its nodes (reserve every device of them)"
    )
    executor: Literal["mp", "ray"] = Field(
        "mp",
        description="vLLM's distributed executor: 'mp' (one vllm serve per node, --nnodes) "
        "or 'ray' (--distributed-executor-backend ray in the run's own placement group; "
        "GPU clusters only)",
    )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def reserved(self) -> int:
        """Devices the run reserves (:func:`orchestrator.cluster.placement.reserved_devices`)."""
        return reserved_devices(
            {
                "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size,
                "devices": self.devices,
            }
        )

    @model_validator(mode="after")
    def _enough_devices(self) -> Layout:
        if self.devices is not None and self.devices % self.world_size != 0:
            raise ValueError(
                f"devices ({self.devices}) must be a multiple of TP x PP ({self.world_size})"
            )
        return self


class RunConfig(BaseModel):
    """One run's configuration: vLLM engine arguments, layout and workload."""

    model_config = ConfigDict(extra="forbid")

    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="vLLM engine arguments, snake_case names"
    )
    layout: Layout = Field(default_factory=Layout)  # type: ignore[arg-type]
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)  # type: ignore[arg-type]


class Factor(BaseModel):
    """One variable and its levels. Several ``paths`` make a linked factor.

    Levels of a one-path factor are plain values; levels of a linked factor
    are objects mapping each of its paths to a value (or lists in ``paths`` order).
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    paths: list[str] = Field(min_length=1, max_length=16)
    levels: list[Any] = Field(min_length=1, max_length=100)
    invariant: Literal["constant_product", "equal_values"] | None = None

    @field_validator("paths")
    @classmethod
    def _paths_ok(cls, value: list[str]) -> list[str]:
        for p in value:
            _check_path(p)
        if len(set(value)) != len(value):
            raise ValueError("paths must be distinct")
        return value

    @model_validator(mode="after")
    def _levels_ok(self) -> Factor:
        if self.invariant and len(self.paths) < 2:
            raise ValueError("an invariant needs a linked factor (two or more paths)")
        normalized: list[Any] = []
        for i, level in enumerate(self.levels):
            if len(self.paths) == 1:
                normalized.append(level)
                continue
            if isinstance(level, list):
                if len(level) != len(self.paths):
                    raise ValueError(
                        f"level {i} has {len(level)} values for {len(self.paths)} paths"
                    )
                level = dict(zip(self.paths, level, strict=True))
            if not isinstance(level, dict) or set(level) != set(self.paths):
                raise ValueError(
                    f"level {i} of linked factor {self.name!r} must set exactly {self.paths}"
                )
            normalized.append(level)
        self.levels = normalized
        return self

    @property
    def linked(self) -> bool:
        return len(self.paths) > 1

    def changes_for(self, level: Any) -> dict[str, Any]:
        return dict(level) if self.linked else {self.paths[0]: level}

    def level_label(self, level: Any) -> str:
        """The level's variant name, ``<factor>=<value>``: characters a name may not
        hold (``/``, quotes...) become ``_`` and it is cut to a name's 100 characters."""
        if not self.linked:
            label = f"{self.name}={_short(level)}"
        else:
            label = f"{self.name}=" + ",".join(_short(level[p]) for p in self.paths)
        return _NAME_UNSAFE.sub("_", label)[:100].rstrip() or "level"


#: Characters :data:`NAME_PATTERN` does not allow after the first.
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.=:,\- ]")


def _short(value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return text[:40]


class Variant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    changes: dict[str, Any] = Field(min_length=1, json_schema_extra=CHANGES_SCHEMA)
    reference: str = Field("baseline", description="the run this one is compared with")

    @field_validator("changes")
    @classmethod
    def _paths_are_dotted(cls, value: dict[str, Any]) -> dict[str, Any]:
        for path in value:
            _check_path(path)
        return value


class LadderOptions(BaseModel):
    """Options of the ``ladder`` preset."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(2, ge=2, le=1024, description="TP of step 3")
    include_tp_step: bool = True
    include_mix_step: bool = True
    mixed_long_fraction: float = Field(
        0.5, gt=0.0, lt=1.0, description="share of long requests in step 4's mixed run"
    )


class GoodputSLOs(BaseModel):
    """Service-level objectives for goodput, in milliseconds (``vllm bench serve --goodput``).

    A measured request is *good* when every given objective holds
    (``value <= objective``); ``request_goodput`` is good requests per second
    and ``goodput_fraction`` their share of the completed ones (DistServe,
    Zhong et al. 2024, as adopted by ``vllm bench serve``).
    """

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(None, gt=0, le=3_600_000, description="time to first token")
    tpot_ms: float | None = Field(None, gt=0, le=3_600_000, description="time per output token")
    e2el_ms: float | None = Field(None, gt=0, le=3_600_000, description="end-to-end latency")

    @model_validator(mode="after")
    def _at_least_one(self) -> GoodputSLOs:
        if self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None:
            raise ValueError("give at least one of ttft_ms, tpot_ms, e2el_ms")
        return self

    def as_loadgen(self) -> dict[str, float]:
        """``{"ttft"|"tpot"|"e2el": ms}`` for :func:`jobs.load.loadgen.summarize`."""
        pairs = (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms))
        return {k: float(v) for k, v in pairs if v is not None}


class ExperimentSpec(BaseModel):
    """What a user submits: ``POST /api/v1/experiments``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = Field(None, max_length=10_000)
    model: str = Field(
        min_length=1,
        max_length=MAX_MODEL_CHARS,
        description="a Hugging Face model id (org/name, resolved in the HF cache of a node "
        "that will run it), a model directory, a name under a model root, or a generated "
        "model (tiny, small)",
    )
    revision: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="Hugging Face revision of a model id: a branch, tag or commit "
        "(default main; no '..'); the run records the snapshot commit it resolved to",
    )
    baseline: RunConfig = Field(default_factory=RunConfig)
    preset: Literal["ladder"] | None = None
    ladder: LadderOptions = Field(default_factory=LadderOptions)  # type: ignore[arg-type]
    factors: list[Factor] = Field(default_factory=list, max_length=50)
    variants: list[Variant] = Field(default_factory=list, max_length=200)
    repeats: int = Field(
        3, ge=1, le=50, strict=True, description="times each variant runs (interleaved)"
    )
    slos: GoodputSLOs | None = Field(
        None, description="goodput objectives applied to every run of the experiment"
    )
    capacity: CapacitySpec | None = Field(
        None,
        description="a capacity search under SLOs in every run of the experiment: the "
        "highest load (request_rate or concurrency) that meets every objective",
    )

    @field_validator("capacity")
    @classmethod
    def _capacity_ok(cls, value: CapacitySpec | None) -> CapacitySpec | None:
        if value is not None:
            problems = capacity_spec_problems(value)
            if problems:
                raise ValueError("; ".join(problems))
        return value

    @field_validator("revision")
    @classmethod
    def _no_parent_steps(cls, value: str | None) -> str | None:
        # a git ref never holds "..", and the revision becomes part of a folder name
        if value is not None and ".." in value:
            raise ValueError("a revision cannot contain '..'")
        return value

    @model_validator(mode="after")
    def _unique_names(self) -> ExperimentSpec:
        names = [f.name for f in self.factors]
        if len(set(names)) != len(names):
            raise ValueError("factor names must be distinct")
        if self.preset == "ladder":
            set_by_ladder = []
            if "enable_prefix_caching" in self.baseline.engine_args:
                set_by_ladder.append("engine_args.enable_prefix_caching")
            if self.baseline.layout.tensor_parallel_size != 1:
                set_by_ladder.append("layout.tensor_parallel_size")
            if self.baseline.layout.pipeline_parallel_size != 1:
                set_by_ladder.append("layout.pipeline_parallel_size")
            if self.baseline.workload.long_fraction != 0:
                set_by_ladder.append("workload.long_fraction")
            if self.ladder.include_mix_step and self.baseline.workload.kind != "shared_prefix":
                raise ValueError(
                    "the ladder's long/short step sets workload.long_fraction, which needs "
                    f"workload kind 'shared_prefix' (got {self.baseline.workload.kind!r}); "
                    "set ladder.include_mix_step to false"
                )
            if set_by_ladder:
                raise ValueError(
                    "the ladder preset sets these itself, remove them from the baseline: "
                    + ", ".join(set_by_ladder)
                )
        return self


class PlannedVariant(BaseModel):
    """A variant the spec expands into (the baseline is position 0)."""

    name: str
    position: int
    reference: str | None
    changes: dict[str, Any]
    variable: str | None = Field(None, description="factor name or the changed path")
    variable_paths: list[str] = Field(default_factory=list)
    config: RunConfig
    source: Literal["baseline", "ladder", "factor", "variant"]
    #: where it comes from in the submitted document (:func:`variant_loc`), set by
    #: :func:`expand`: where the planner locates its problems
    loc: list[str | int] = Field(default_factory=list)


def set_path(doc: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node = doc
    for part in parts[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = {}
            node[part] = nxt
        if not isinstance(nxt, dict):
            raise KeyError(path)
        node = nxt
    node[parts[-1]] = value


def flatten(doc: dict[str, Any]) -> dict[str, Any]:
    """A run configuration document as ``{"<section>.<name>": value}``.

    Values inside a section are leaves even when they are objects (an engine
    argument such as ``compilation_config`` is one variable).
    """
    return {
        f"{section}.{key}": value
        for section, body in doc.items()
        if isinstance(body, dict)
        for key, value in body.items()
    }


def apply_changes(base: RunConfig, changes: dict[str, Any]) -> RunConfig:
    """Return ``base`` with each dotted path in ``changes`` set; re-validated.

    Raises :class:`pydantic.ValidationError` when the result is invalid and
    ``KeyError`` when a path runs through a non-object value.
    """
    doc = copy.deepcopy(base.model_dump(mode="json"))
    for path, value in changes.items():
        set_path(doc, path, value)
    return RunConfig.model_validate(doc)


def config_diff(a: RunConfig, b: RunConfig) -> dict[str, tuple[Any, Any]]:
    """Every leaf path whose value differs: ``{path: (value in a, value in b)}``.

    Engine arguments count as set only when explicit; an argument absent on
    one side compares as ``None`` (vLLM's default; the resolved check in
    :mod:`orchestrator.experiments.planner` compares real defaults).
    """
    fa, fb = flatten(a.model_dump(mode="json")), flatten(b.model_dump(mode="json"))
    diff: dict[str, tuple[Any, Any]] = {}
    for path in sorted(set(fa) | set(fb)):
        va, vb = fa.get(path), fb.get(path)
        if path in ("layout.devices",):
            va, vb = a.layout.reserved, b.layout.reserved
        if va != vb:
            diff[path] = (va, vb)
    return diff


def variables_of(paths: list[str], factors: list[Factor]) -> dict[str, list[str]]:
    """Group changed ``paths`` into variables: ``{variable name: [paths]}``.

    A declared linked factor groups its paths under the factor's name; any
    other path is a variable by itself.
    """
    groups: dict[str, list[str]] = {}
    linked = {p: f.name for f in factors if f.linked for p in f.paths}
    for p in paths:
        groups.setdefault(linked.get(p, p), []).append(p)
    return groups


def check_invariant(factor: Factor, ref: RunConfig, new: RunConfig) -> str | None:
    """The broken invariant's description, or None when it holds."""
    if factor.invariant is None:
        return None
    fr, fn = flatten(ref.model_dump(mode="json")), flatten(new.model_dump(mode="json"))
    ref_vals = [fr.get(p) for p in factor.paths]
    new_vals = [fn.get(p) for p in factor.paths]
    if factor.invariant == "constant_product":
        try:
            pr, pn = 1.0, 1.0
            for a, b in zip(ref_vals, new_vals, strict=True):
                pr *= float(a)  # type: ignore[arg-type]
                pn *= float(b)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return f"constant_product needs numbers at {factor.paths}"
        if pr != pn:
            return (
                f"invariant constant_product broken: product of {factor.paths} is "
                f"{pr:g} in the reference and {pn:g} here"
            )
    elif len(set(map(str, new_vals))) != 1:
        return f"invariant equal_values broken: {dict(zip(factor.paths, new_vals, strict=True))}"
    return None


def ladder_variants(spec: ExperimentSpec) -> tuple[RunConfig, list[Variant]]:
    """The tuning ladder built from the spec's baseline.

    Steps (each step's reference is the previous step, so the chain is
    cumulative): (1) baseline with prefix caching off on the smallest layout
    (TP=1, PP=1) holding ``ladder.tensor_parallel_size`` devices, (2) prefix
    caching on, (3) TP raised to ``ladder.tensor_parallel_size`` on the same
    devices, (4) long and short requests measured separately and mixed: step
    3 (short requests only) is the short measurement, ``4-long-only`` sends
    long-document requests only and ``4-mixed`` mixes them
    (``ladder.mixed_long_fraction``); both refer to step 3 and share its
    server (a client-side change). Returns (step-1 configuration, variants).
    """
    tp = spec.ladder.tensor_parallel_size
    doc = spec.baseline.model_dump(mode="json")
    doc["engine_args"]["enable_prefix_caching"] = False
    doc["workload"]["long_fraction"] = 0.0
    doc["layout"] = {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "devices": tp if spec.ladder.include_tp_step else None,
    }
    base = RunConfig.model_validate(doc)
    steps = [
        Variant(
            name="2-apc-on",
            changes={"engine_args.enable_prefix_caching": True},
            reference="1-baseline",
        )
    ]
    if spec.ladder.include_tp_step:
        steps.append(
            Variant(
                name=f"3-tp{tp}",
                changes={"layout.tensor_parallel_size": tp},
                reference="2-apc-on",
            )
        )
    if spec.ladder.include_mix_step:
        # the previous step sends short requests only: it is the "short alone" measurement
        last = steps[-1].name
        steps.append(
            Variant(name="4-long-only", changes={"workload.long_fraction": 1.0}, reference=last)
        )
        steps.append(
            Variant(
                name="4-mixed",
                changes={"workload.long_fraction": spec.ladder.mixed_long_fraction},
                reference=last,
            )
        )
    return base, steps


#: What :func:`expand` returns: the variants and every problem of the spec's own rules.
Expansion = tuple[list[PlannedVariant], list[dict[str, Any]]]


#: Where a variant comes from: (variant, its location, its source, its factor if any).
_Source = tuple[Variant, list[str | int], str, "Factor | None"]


def expand(spec: ExperimentSpec) -> Expansion:
    """Expand a spec into its variants (baseline first); return (variants, errors).

    ``errors`` entries are ``{"loc": [...], "msg": str, "type": str}``: a
    variant that is invalid after its changes, refers to an unknown
    reference, changes nothing, changes more than one variable (every
    differing variable named with its two values), or breaks its factor's
    invariant.
    """
    errors: list[dict[str, Any]] = []
    base_name, base_config, sources = _sources(spec)
    locs: dict[str, list[str | int]] = {base_name: ["body", "baseline"]}
    planned: dict[str, PlannedVariant] = {
        base_name: PlannedVariant(
            name=base_name,
            position=0,
            reference=None,
            changes={},
            config=base_config,
            source="baseline",
        )
    }
    for variant, loc, source, from_factor in sources:
        if variant.name in planned:
            errors.append(
                {
                    "loc": [*loc, "name"],
                    "msg": f"name {variant.name!r} is used twice",
                    "type": "duplicate_name",
                }
            )
            continue
        reference = variant.reference
        if source == "variant" and variant.reference == "baseline":
            reference = base_name
        ref = planned.get(reference)
        if ref is None:
            errors.append(
                {
                    "loc": [*loc, "reference"],
                    "msg": f"unknown reference {variant.reference!r} (must be defined earlier)",
                    "type": "unknown_reference",
                }
            )
            continue
        derived = _derive(spec, (variant, loc, source, from_factor), ref, len(planned))
        if isinstance(derived, list):
            errors += derived
            continue
        planned[variant.name] = derived
        locs[variant.name] = loc
    for pv in planned.values():
        pv.loc = variant_loc(spec, pv)
    if spec.capacity is not None:
        errors += capacity_errors(spec.capacity, list(planned.values()), locs)
    return list(planned.values()), errors


def _sources(spec: ExperimentSpec) -> tuple[str, RunConfig, list[_Source]]:
    """The baseline's name and configuration, and every variant the spec declares, in
    order: the ladder's steps, each factor's levels, the explicit variants."""
    base_name = "baseline"
    base_config = spec.baseline
    sources: list[_Source] = []
    if spec.preset == "ladder":
        base_name = "1-baseline"
        base_config, steps = ladder_variants(spec)
        sources += [(v, ["body", "preset"], "ladder", None) for v in steps]
    for fi, factor in enumerate(spec.factors):
        for li, level in enumerate(factor.levels):
            v = Variant(
                name=factor.level_label(level),
                changes=factor.changes_for(level),
                reference=base_name,
            )
            sources.append((v, ["body", "factors", fi, "levels", li], "factor", factor))
    for vi, variant in enumerate(spec.variants):
        sources.append((variant, ["body", "variants", vi], "variant", None))
    return base_name, base_config, sources


def _derive(
    spec: ExperimentSpec, source: _Source, ref: PlannedVariant, position: int
) -> PlannedVariant | list[dict[str, Any]]:
    """One declared variant applied to its reference ``ref``: the planned variant, or why
    not (invalid after its changes, no change, a broken invariant, more than one
    variable)."""
    variant, loc, kind, from_factor = source
    try:
        config = apply_changes(ref.config, variant.changes)
    except KeyError as exc:
        return [{"loc": [*loc, "changes"], "msg": f"cannot set {exc.args[0]}", "type": "bad_path"}]
    except ValidationError as exc:
        return [
            {
                "loc": [*loc, "changes", ".".join(str(p) for p in err["loc"])],
                "msg": err["msg"],
                "type": err["type"],
            }
            for err in exc.errors()
        ]
    diff = config_diff(ref.config, config)
    if not diff:
        same = (
            f"nothing changes: every value equals the reference {ref.name!r} ("
            + ", ".join(f"{k}={v!r}" for k, v in variant.changes.items())
            + ")"
        )
        return [{"loc": [*loc, "changes"], "msg": same, "type": "no_change"}]
    owners = [from_factor] if from_factor is not None else []
    owners += [
        f for f in spec.factors if f.linked and f is not from_factor and set(f.paths) & set(diff)
    ]
    broken = next((msg for f in owners if (msg := check_invariant(f, ref.config, config))), None)
    if broken:
        return [{"loc": [*loc, "changes"], "msg": broken, "type": "invariant_broken"}]
    groups = variables_of(list(diff), spec.factors)
    if len(groups) > 1:
        return [
            {
                "loc": [*loc, "changes"],
                "msg": f"changes {len(groups)} variables vs {ref.name!r}, one is allowed: "
                + "; ".join(f"{p}: {diff[p][0]!r} -> {diff[p][1]!r}" for p in diff),
                "type": "more_than_one_variable",
                "variables": {p: list(diff[p]) for p in diff},
            }
        ]
    ((variable, paths),) = groups.items()
    return PlannedVariant(
        name=variant.name,
        position=position,
        reference=ref.name,
        changes=dict(variant.changes),
        variable=variable,
        variable_paths=sorted(paths),
        config=config,
        source=kind,  # type: ignore[arg-type]
    )


def variant_loc(spec: ExperimentSpec, variant: PlannedVariant) -> list[str | int]:
    """Where ``variant`` comes from in the submitted document."""
    if variant.source == "variant":
        idx = next(i for i, v in enumerate(spec.variants) if v.name == variant.name)
        return ["body", "variants", idx]
    if variant.source == "factor":
        return ["body", "factors", variant.variable or ""]
    if variant.source == "ladder":
        return ["body", "preset", variant.name]
    return ["body", "baseline"]
