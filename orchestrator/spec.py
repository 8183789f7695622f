"""The experiment spec (first version) and its expansion into runs.

A spec is a baseline configuration plus variants. Each variant's ``changes``
maps dotted paths (``engine_args.enable_prefix_caching``,
``layout.tensor_parallel_size``, ``workload.concurrency``) to new values;
everything else is inherited from the baseline. Every variant must change
exactly one variable, and that change must actually differ from the
baseline's value.

Example::

    {"name": "apc", "model": "small",
     "baseline": {"engine_args": {"enable_prefix_caching": false},
                  "layout": {"tensor_parallel_size": 1},
                  "workload": {"num_requests": 16, "concurrency": 1}},
     "variants": [{"name": "apc-on",
                   "changes": {"engine_args.enable_prefix_caching": true}}]}
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from jobs.schemas import WorkloadSpec

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\- ]{0,99}$"
SECTIONS = ("engine_args", "layout", "workload")


class Layout(BaseModel):
    """Parallel layout: TP x PP devices (GPUs; cores on a CPU host)."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(1, ge=1, le=1024)
    pipeline_parallel_size: int = Field(1, ge=1, le=1024)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class RunConfig(BaseModel):
    """One run's configuration: vLLM engine arguments, layout and workload."""

    model_config = ConfigDict(extra="forbid")

    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="vLLM engine arguments, snake_case names"
    )
    layout: Layout = Field(default_factory=Layout)
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)  # type: ignore[arg-type]


class Variant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    changes: dict[str, Any] = Field(min_length=1)

    @field_validator("changes")
    @classmethod
    def _paths_are_dotted(cls, value: dict[str, Any]) -> dict[str, Any]:
        for path in value:
            head = path.split(".", 1)[0]
            if head not in SECTIONS or "." not in path:
                raise ValueError(
                    f"change path {path!r} must start with one of "
                    f"{', '.join(s + '.' for s in SECTIONS)}"
                )
        return value


class ExperimentSpec(BaseModel):
    """What a user submits: ``POST /api/v1/experiments``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = Field(None, max_length=10_000)
    model: str = Field(
        min_length=1,
        max_length=500,
        description="a generated model's name (tiny, small) or a model directory",
    )
    baseline: RunConfig = Field(default_factory=RunConfig)
    variants: list[Variant] = Field(default_factory=list, max_length=200)

    @field_validator("variants")
    @classmethod
    def _unique_names(cls, value: list[Variant]) -> list[Variant]:
        seen: set[str] = set()
        for v in value:
            if v.name in seen or v.name == "baseline":
                raise ValueError(f"variant name {v.name!r} is used twice (or is 'baseline')")
            seen.add(v.name)
        return value


class PlannedRun(BaseModel):
    """A run the spec expands into, before defaults are resolved."""

    name: str
    position: int
    is_baseline: bool
    changes: dict[str, Any]
    config: RunConfig


def _set_path(doc: dict[str, Any], path: str, value: Any) -> None:
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


def _get_path(doc: dict[str, Any], path: str) -> Any:
    node: Any = doc
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def apply_changes(base: RunConfig, changes: dict[str, Any]) -> RunConfig:
    """Return ``base`` with each dotted path in ``changes`` set; re-validated.

    Raises :class:`pydantic.ValidationError` when the result is invalid and
    ``KeyError`` when a path runs through a non-object value.
    """
    doc = copy.deepcopy(base.model_dump(mode="json"))
    for path, value in changes.items():
        _set_path(doc, path, value)
    return RunConfig.model_validate(doc)


def expand(spec: ExperimentSpec) -> tuple[list[PlannedRun], list[dict[str, Any]]]:
    """Expand a spec into the baseline and one run per variant.

    Returns ``(runs, errors)``; ``errors`` entries are
    ``{"loc": [...], "msg": str, "type": str}`` for every variant that is
    invalid after its changes are applied or that does not change exactly
    one variable.
    """
    runs = [
        PlannedRun(name="baseline", position=0, is_baseline=True, changes={}, config=spec.baseline)
    ]
    errors: list[dict[str, Any]] = []
    base_doc = spec.baseline.model_dump(mode="json")
    for i, variant in enumerate(spec.variants):
        loc: list[str | int] = ["body", "variants", i, "changes"]
        if len(variant.changes) != 1:
            errors.append(
                {
                    "loc": loc,
                    "msg": "a variant must change exactly one variable; this one changes "
                    + ", ".join(sorted(variant.changes)),
                    "type": "more_than_one_variable",
                }
            )
            continue
        try:
            config = apply_changes(spec.baseline, variant.changes)
        except KeyError as exc:
            errors.append({"loc": loc, "msg": f"cannot set {exc.args[0]}", "type": "bad_path"})
            continue
        except ValidationError as exc:
            for err in exc.errors():
                errors.append(
                    {
                        "loc": [*loc, ".".join(str(p) for p in err["loc"])],
                        "msg": err["msg"],
                        "type": err["type"],
                    }
                )
            continue
        ((path, value),) = variant.changes.items()
        new_doc = config.model_dump(mode="json")
        if _get_path(new_doc, path) == _get_path(base_doc, path) and new_doc == base_doc:
            errors.append(
                {
                    "loc": [*loc, path],
                    "msg": f"{path} is already {value!r} in the baseline: nothing changes",
                    "type": "no_change",
                }
            )
            continue
        runs.append(
            PlannedRun(
                name=variant.name,
                position=i + 1,
                is_baseline=False,
                changes=dict(variant.changes),
                config=config,
            )
        )
    return runs, errors
