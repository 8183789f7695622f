"""What a user submits to start a tuning campaign: ``POST /api/v1/campaigns``.

A campaign request is the fixed part of every run (``model``, ``revision``, ``baseline``:
engine arguments, layout and workload as an experiment spec writes them), the
**objective** (one of the summary metrics every run stores, named as ``vllm bench
serve`` names them, such a throughput per device the run reserved, the GPUs' energy
per output token, or, with a ``capacity`` search, the capacity under SLOs, and its
direction), the **space** (variables as dotted spec paths,
each with its levels in order and a starting level; or ``"auto"``: the intake proposes
them, :mod:`orchestrator.tuning.auto_space`), the **budget** (runs in all, the
confirmation included; optionally device-hours and wall-clock hours) and the **decision rule**
(:class:`orchestrator.campaigns.decision.DecisionRule`).
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from jobs.capacity.search import CapacitySpec
from orchestrator.campaigns.decision import DecisionRule, Direction
from orchestrator.campaigns.outcomes import Constraint
from orchestrator.campaigns.space import Level, Space
from orchestrator.experiments.pathpolicy import MAX_MODEL_CHARS
from orchestrator.experiments.spec import NAME_PATTERN, Layout, set_path

#: The objectives a campaign may optimise: stored run metrics (``run_metrics.name``, as
#: :func:`jobs.load.loadgen.summarize` names them) and the direction each improves in.
OBJECTIVES: dict[str, Direction] = {
    "output_throughput": Direction.HIGHER,
    "total_token_throughput": Direction.HIGHER,
    "request_throughput": Direction.HIGHER,
    "median_ttft_ms": Direction.LOWER,
    "p99_ttft_ms": Direction.LOWER,
    "median_tpot_ms": Direction.LOWER,
    "p99_tpot_ms": Direction.LOWER,
    "median_itl_ms": Direction.LOWER,
    "p99_itl_ms": Direction.LOWER,
    "median_e2el_ms": Direction.LOWER,
    "p99_e2el_ms": Direction.LOWER,
    "output_throughput_per_device": Direction.HIGHER,
    "total_token_throughput_per_device": Direction.HIGHER,
    "energy_per_output_token_j": Direction.LOWER,
    "capacity": Direction.HIGHER,
    "capacity_per_device": Direction.HIGHER,
}

#: Objectives a capacity search under SLOs gives (the request's ``capacity``): the load at
#: the boundary, and the same over the devices the run reserved.
CAPACITY_OBJECTIVES = ("capacity", "capacity_per_device")

#: Objectives read as a stored metric over the devices the run reserved (TP x PP, or its
#: ``layout.devices``): what a configuration yields per device it holds.
PER_DEVICE: dict[str, str] = {
    "output_throughput_per_device": "output_throughput",
    "total_token_throughput_per_device": "total_token_throughput",
}

#: Objectives only GPU telemetry gives (NVML's energy counter over the measured phase,
#: :mod:`jobs.signals.gpus`): a run without the reading says nothing of its configuration.
GPU_TELEMETRY = ("energy_per_output_token_j",)


def stored_metric(name: str) -> str:
    """The stored run metric objective or constraint ``name`` is read from."""
    return PER_DEVICE.get(name, name)


#: Workload fields the load generator applies: changing only these keeps the server.
CLIENT_SIDE = ("workload.concurrency", "workload.request_rate")


class Objective(BaseModel):
    """The metric to improve; ``direction`` defaults to the metric's own (and may not
    contradict it)."""

    model_config = ConfigDict(extra="forbid")

    metric: str = Field(description="a stored run metric: " + ", ".join(OBJECTIVES))
    direction: Direction | None = None

    @property
    def resolved_direction(self) -> Direction:
        return self.direction or OBJECTIVES[self.metric]


class SpaceVariable(BaseModel):
    """One variable of the space: a dotted spec path, its levels in order, where it starts
    (default: the baseline's value at that path)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        pattern=r"^(engine_args|layout|workload)\.[A-Za-z_][A-Za-z0-9_]*$",
        description="engine_args.<argument>, layout.<field> or workload.<field>",
    )
    levels: list[Level] = Field(min_length=2, max_length=20)
    start: Level | None = Field(None, description="the starting level (default: the baseline's)")


#: A listed space as validated (errors located at ``space``, ``space.<i>...``, without the
#: union's member names).
_SPACE_LIST: TypeAdapter[list[SpaceVariable]] = TypeAdapter(
    Annotated[list[SpaceVariable], Field(min_length=1, max_length=20)]
)

#: The space that asks vlab to propose the variables and their levels.
AUTO_SPACE = "auto"


class ConstraintIn(BaseModel):
    """A stored run metric that must keep holding (an SLO), in its unit: ``max`` and/or
    ``min``. A candidate that pays but breaks it (the median of its runs) is
    ``infeasible``, never adopted."""

    model_config = ConfigDict(extra="forbid")

    metric: str = Field(description="a stored run metric: " + ", ".join(OBJECTIVES))
    max: float | None = Field(None, description="the largest value that holds")
    min: float | None = Field(None, description="the smallest value that holds")

    @model_validator(mode="after")
    def _bounds(self) -> ConstraintIn:
        if self.max is None and self.min is None:
            raise ValueError("a constraint needs max, min or both")
        if self.max is not None and self.min is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}: nothing holds")
        return self

    def core(self) -> Constraint:
        return Constraint(metric=self.metric, max=self.max, min=self.min)


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_runs: int = Field(
        40, ge=4, le=2000, description="runs in all, the confirmation's 2 x max_repeats included"
    )
    max_device_hours: float | None = Field(
        None,
        gt=0,
        le=100_000,
        description="device-hours the campaign's runs may hold (each run: its reserved "
        "devices x its time from claim to end); the rounds stop when the runs left at the "
        "mean so far would pass it, the confirmation's included",
    )
    max_wall_hours: float | None = Field(
        None,
        gt=0,
        le=10_000,
        description="wall-clock hours from the campaign's submission: a cycle is queued only "
        "while the runs it and the confirmation need, at the mean wall time per run so far, "
        "end before it",
    )


class CampaignRequest(BaseModel):
    """A tuning campaign as submitted (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, max_length=80)
    description: str | None = Field(None, max_length=10_000)
    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS)
    revision: str | None = Field(None, min_length=1, max_length=200)
    baseline: dict[str, Any] = Field(
        default_factory=dict,
        description="the fixed configuration: engine_args, layout, workload (an experiment "
        "spec's baseline); the space's variables start from their start levels",
    )
    objective: Objective
    constraints: list[ConstraintIn] = Field(
        default_factory=list,
        max_length=10,
        description="metrics that must keep holding (SLOs): a paying candidate that breaks "
        "one is infeasible",
    )
    capacity: CapacitySpec | None = Field(
        None,
        description="a capacity search under SLOs in every run (as an experiment's "
        "`capacity`); the objective is then `capacity` or `capacity_per_device`",
    )
    space: list[SpaceVariable] | Literal["auto"] = Field(
        description='1 to 20 variables, or "auto": vlab proposes them from the workload, '
        "the model and the cluster (the intake replaces it with the proposal)"
    )
    budget: Budget = Field(default_factory=Budget)
    rule: DecisionRule = Field(default_factory=DecisionRule)  # type: ignore[arg-type]

    @field_validator("space", mode="wrap")
    @classmethod
    def _space(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return value if value == AUTO_SPACE else _SPACE_LIST.validate_python(value)

    @property
    def auto_space(self) -> bool:
        """Whether vlab is to propose the space (the request as submitted)."""
        return self.space == AUTO_SPACE

    def variables(self) -> list[SpaceVariable]:
        """The space's variables; ``ValueError`` while the space is still ``"auto"`` (the
        intake replaces it with the proposal before anything reads it)."""
        if isinstance(self.space, str):
            raise ValueError('the space is still "auto": the intake proposes it')
        return self.space

    def core_space(self) -> Space:
        """The space as the pure core takes it (raises ``ValueError`` when it is not one)."""
        # validated as one document: a problem is located at its variable's index
        return Space.model_validate(
            {
                "variables": [
                    {
                        "name": v.name,
                        "levels": tuple(v.levels),
                        "client_side": v.name in CLIENT_SIDE,
                    }
                    for v in self.variables()
                ]
            }
        )

    def baseline_value(self, path: str) -> Level | None:
        """The baseline's value at dotted ``path`` when it is a level, else None."""
        node: Any = self.baseline
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node if isinstance(node, bool | int | float | str) else None

    def start_level(self, v: SpaceVariable) -> Level | None:
        """``v``'s starting level: its ``start``, else the baseline's value, else a layout
        field's default (TP and PP 1, as an experiment's), else None."""
        if v.start is not None:
            return v.start
        value = self.baseline_value(v.name)
        section, name = v.name.split(".", 1)
        if value is None and section == "layout" and name in Layout.model_fields:
            default = Layout.model_fields[name].default
            value = default if isinstance(default, bool | int | float | str) else None
        return value

    def start(self) -> dict[str, Level]:
        """The starting configuration (every variable at its start level); ``ValueError``
        when one has none."""
        config: dict[str, Level] = {}
        for v in self.variables():
            level = self.start_level(v)
            if level is None:
                raise ValueError(f"{v.name}: no starting level")
            config[v.name] = level
        return config

    def experiment_doc(
        self,
        name: str,
        config: dict[str, Level],
        variants: list[dict[str, Any]],
        description: str | None = None,
    ) -> dict[str, Any]:
        """An experiment spec document: the baseline at ``config`` (each variable's path
        set to its level), ``variants`` after it, one repeat each (a campaign's cycles are
        its repeats)."""
        baseline = copy.deepcopy(self.baseline)
        for path, level in config.items():
            set_path(baseline, path, level)
        doc: dict[str, Any] = {
            "name": name,
            "model": self.model,
            "baseline": baseline,
            "variants": variants,
            "repeats": 1,
        }
        if self.revision is not None:
            doc["revision"] = self.revision
        if self.capacity is not None:
            doc["capacity"] = self.capacity.model_dump(mode="json", exclude_unset=True)
        if description:
            doc["description"] = description
        return doc
