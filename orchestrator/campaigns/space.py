"""A campaign's space: the variables it may change, their ordered levels, and the
one-variable neighbours of a configuration.

A **variable** is a dotted name as experiment specs write it (``engine_args.max_num_seqs``,
``workload.concurrency``) with its candidate **levels** in order (``32, 64, 128``; a boolean
is ``False, True``). A **configuration** maps every variable of the space to one of its
levels (other keys, the fixed part of a spec, may ride along and are never changed). A
**candidate** changes exactly one variable of the incumbent by one level step: the
neighbours of ``{max_num_seqs: 128}`` over ``32, 64, 128, 256`` are ``64`` and ``256``; a
boolean flips. ``client_side`` marks a variable the load generator applies (concurrency,
request rate): changing only such variables keeps the same server.

Pure: no database, no Ray, no HTTP.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: One level of a variable: what a spec field holds.
Level = bool | int | float | str

#: A configuration: variable name -> level (plus any fixed keys a spec carries).
Config = Mapping[str, Level]

#: A configuration as a hashable value: ``(name, type name, level)`` sorted by name.
ConfigKey = tuple[tuple[str, str, Level], ...]


def config_key(config: Config) -> ConfigKey:
    """``config`` as a sorted tuple, to hash and compare configurations.

    Levels are keyed with their type, so ``True`` and ``1`` stay different configurations.
    """
    return tuple(sorted((name, type(level).__name__, level) for name, level in config.items()))


def _same_level(a: Level, b: Level) -> bool:
    return type(a) is type(b) and a == b


class Variable(BaseModel):
    """One knob of the space, its levels in order (the step between neighbours is one)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z_][\w.]*$")
    levels: tuple[Level, ...] = Field(min_length=2)
    client_side: bool = False

    @field_validator("levels")
    @classmethod
    def _distinct(cls, levels: tuple[Level, ...]) -> tuple[Level, ...]:
        for i, a in enumerate(levels):
            if isinstance(a, float) and not math.isfinite(a):
                raise ValueError(f"level {a!r} is not finite")
            if any(_same_level(a, b) for b in levels[:i]):
                raise ValueError(f"level {a!r} is listed twice")
        return levels

    @classmethod
    def boolean(cls, name: str, *, client_side: bool = False) -> Variable:
        """A flag: levels ``False, True``; its one neighbour is the other value."""
        return cls(name=name, levels=(False, True), client_side=client_side)

    def index(self, level: Level) -> int:
        """The position of ``level``; ``ValueError`` when it is not one of the levels."""
        for i, candidate in enumerate(self.levels):
            if _same_level(candidate, level):
                return i
        raise ValueError(f"{self.name}: {level!r} is not one of its levels {list(self.levels)}")


class Space(BaseModel):
    """The variables a campaign may change, in the order the seeds' experiment order gives
    (the default order of the candidates)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    variables: tuple[Variable, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Space:
        names = [v.name for v in self.variables]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"variables named twice: {repeated}")
        return self

    def variable(self, name: str) -> Variable:
        """The variable called ``name``; ``KeyError`` when the space has none."""
        for v in self.variables:
            if v.name == name:
                return v
        raise KeyError(name)

    def check(self, config: Config) -> None:
        """``ValueError`` unless ``config`` sets every variable to one of its levels."""
        missing = [v.name for v in self.variables if v.name not in config]
        if missing:
            raise ValueError(f"the configuration does not set {missing}")
        for v in self.variables:
            v.index(config[v.name])

    def server_key(self, config: Config) -> ConfigKey:
        """What decides the server of ``config``: every key but the client-side variables."""
        client = {v.name for v in self.variables if v.client_side}
        return config_key({k: level for k, level in config.items() if k not in client})


class Candidate(BaseModel):
    """One variable of the incumbent moved to a neighbouring level."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    variable: str
    from_level: Level
    to_level: Level

    @property
    def label(self) -> str:
        """``engine_args.max_num_seqs=128``: names the candidate in run labels and reports."""
        return f"{self.variable}={show_level(self.to_level)}"

    def describe(self) -> str:
        """``engine_args.max_num_seqs: 256 -> 128``."""
        return f"{self.variable}: {show_level(self.from_level)} -> {show_level(self.to_level)}"

    def apply(self, config: Config) -> dict[str, Level]:
        """``config`` with this change made; ``ValueError`` when it is not from ``from_level``."""
        if self.variable not in config or not _same_level(config[self.variable], self.from_level):
            raise ValueError(f"{self.describe()} does not start from {dict(config)}")
        return {**config, self.variable: self.to_level}


def show_level(level: Level) -> str:
    """A level as the spec writes it: ``true``, ``128``, ``fp8``."""
    return str(level).lower() if isinstance(level, bool) else str(level)


def neighbours(incumbent: Config, space: Space) -> list[Candidate]:
    """The one-variable neighbours of ``incumbent``: per variable in the space's order, the
    level one step down, then one step up (a boolean: the other value).

    Raises ``ValueError`` when ``incumbent`` does not set every variable to one of its levels.
    """
    space.check(incumbent)
    found: list[Candidate] = []
    for v in space.variables:
        i = v.index(incumbent[v.name])
        for j in (i - 1, i + 1):
            if 0 <= j < len(v.levels):
                found.append(
                    Candidate(variable=v.name, from_level=v.levels[i], to_level=v.levels[j])
                )
    return found


def grid_size(space: Space) -> int:
    """The number of configurations of the full grid: the product of the level counts."""
    return math.prod(len(v.levels) for v in space.variables)


def grid(space: Space, fixed: Config | None = None) -> list[dict[str, Level]]:
    """Every configuration of the full grid (the first variable varies slowest), each with
    the ``fixed`` keys; what a grid sweep runs, for baselines and tests."""
    configs: list[dict[str, Level]] = [dict(fixed or {})]
    for v in space.variables:
        configs = [{**c, v.name: level} for c in configs for level in v.levels]
    return configs
