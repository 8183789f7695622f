"""What a campaign plans and decides: its runs, the candidates table, the path's steps,
the confirmation, and the ``order`` hook's answer.

Value types only (pydantic models and frozen dataclasses, JSON-friendly for the REST and
dashboard layers); the loop that produces them is :mod:`orchestrator.campaigns.loop`.

Pure: no database, no Ray, no HTTP.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from orchestrator.campaigns.decision import Gain, Verdict
from orchestrator.campaigns.space import Candidate, Config, ConfigKey, Level


class Outcome(StrEnum):
    """How a candidate of a round ended.

    The issue's five (``adopted``, ``inert``, ``worse``, ``unknown``, ``skipped``) and the
    ways a candidate ends not adopted without being inert or worse: ``outpaid`` (it paid, or
    could have, but a candidate of its round paid more), ``marginal`` (a real gain, shown
    below the smallest gain worth adopting), ``undecided`` (no verdict after
    ``max_repeats``), ``failed`` (its run failed: the configuration's fault, e.g. an
    engine that refuses it or runs out of memory). A run lost to the infrastructure is
    measured again (:data:`~orchestrator.campaigns.loop.MAX_RETRIES` times at most); a
    candidate whose run is lost past that, or with no budget left to measure it again,
    ends ``unknown``. ``infeasible``: it paid, but a constraint (:class:`Constraint`) did
    not hold on its runs, or could not be shown to. ``measuring`` is a candidate of the
    round in progress.
    """

    ADOPTED = "adopted"
    INFEASIBLE = "infeasible"
    INERT = "inert"
    WORSE = "worse"
    UNKNOWN = "unknown"
    SKIPPED = "skipped"
    OUTPAID = "outpaid"
    MARGINAL = "marginal"
    UNDECIDED = "undecided"
    FAILED = "failed"
    MEASURING = "measuring"


class Phase(StrEnum):
    """Where the campaign is: measuring rounds, confirming, or done."""

    ROUNDS = "rounds"
    CONFIRMING = "confirming"
    DONE = "done"


class Role(StrEnum):
    """What a run measures: a round's incumbent or candidate, the confirmation's two ends."""

    INCUMBENT = "incumbent"
    CANDIDATE = "candidate"
    START = "start"
    FINAL = "final"


@dataclass(frozen=True)
class PlannedRun:
    """One run to do. ``label`` is unique in the campaign (the run's idempotency key);
    ``round`` is 0 for the confirmation; ``server_key`` is equal for runs that may share a
    server (only client-side variables differ); ``attempt`` is 0, or the how-manieth time
    the run is measured again after a run lost to the infrastructure (its label is the
    first one's with ``.retry<attempt>``)."""

    label: str
    config: dict[str, Level]
    role: Role
    round: int
    cycle: int
    candidate: Candidate | None
    server_key: ConfigKey
    attempt: int = 0


@dataclass(frozen=True)
class Recorded:
    """A run's measurement: ``value`` is the objective, ``None`` when the run failed;
    ``lost`` when it ended because the infrastructure lost it (its orchestrator,
    supervisor or node died), not because its configuration fails: it is measured again."""

    label: str
    value: float | None
    lost: bool = False
    why: str | None = None  # what happened to a lost run (its finding, ...)
    checks: Mapping[str, float | None] | None = None  # its constraints' metrics
    device_s: float | None = None  # device-seconds it held
    ended_s: float | None = None  # when it ended, seconds after the campaign began
    again: bool = True  # a lost run: whether measuring it again could give a value


@dataclass
class CostBudget:
    """A budget besides the runs (``limit``; None: none): what the ``count`` runs recorded
    with a cost used, their sum (device-seconds) or, for a ``clock``, the latest (the
    campaign's wall time at a run's end)."""

    name: str
    limit: float | None
    clock: bool = False
    used: float = 0.0
    count: int = 0

    def add(self, cost: float | None) -> None:
        if cost is not None:
            self.used = max(self.used, cost) if self.clock else self.used + cost
            self.count += 1

    def runs_left(self) -> int | None:
        """The runs it affords at the mean cost per run so far; None when it has no limit
        or no cost was seen yet."""
        if self.limit is None or not self.count or not self.used:
            return None
        return int((self.limit - self.used) // (self.used / self.count))


@dataclass(frozen=True)
class Triage:
    """What the ``order`` hook says of a candidate: run it (in the list's order) or skip it
    with ``skip`` as the reason (e.g. "the prefix analyser predicts no hits")."""

    candidate: Candidate
    skip: str | None = None


#: Orders the neighbours of an incumbent: every candidate once, in the order to measure.
OrderHook = Callable[[Config, Sequence[Candidate]], Sequence[Triage]]


class CandidateResult(BaseModel):
    """One row of the candidates table: a candidate of a round and how it ended."""

    model_config = ConfigDict(frozen=True)

    round: int
    candidate: Candidate
    outcome: Outcome
    verdict: Verdict | None
    gain: Gain | None
    pairs: int
    reason: str


class Step(BaseModel):
    """One adopted change of the path: its variable, from -> to, gain, verdict and why."""

    model_config = ConfigDict(frozen=True)

    round: int
    variable: str
    from_level: Level
    to_level: Level
    gain: Gain
    verdict: Verdict
    reason: str


class Confirmation(BaseModel):
    """The final configuration against the starting one: ``total`` measured, ``steps`` the
    sum of the step gains, ``interaction`` their difference (total minus steps);
    ``agrees`` when the interaction's interval holds 0."""

    model_config = ConfigDict(frozen=True)

    total: Gain
    steps: Gain
    interaction: Gain
    agrees: bool


def server_starts(runs: Sequence[PlannedRun]) -> int:
    """Server starts when ``runs`` run one after another on one server slot: one at each
    change of ``server_key`` (consecutive runs that differ only in client-side variables
    share a server)."""
    starts = 0
    previous: ConfigKey | None = None
    for run in runs:
        if run.server_key != previous:
            starts += 1
            previous = run.server_key
    return starts


@dataclass(frozen=True)
class Constraint:
    """A metric that must keep holding (an SLO): ``max`` and/or ``min``, in the metric's
    unit. It holds for a candidate when the median of its runs' values is within the
    bounds, over at least half its runs with a value (a value a finding flags is none)."""

    metric: str
    max: float | None = None
    min: float | None = None

    def describe(self) -> str:
        parts = [f"{self.metric} >= {self.min:g}"] if self.min is not None else []
        parts += [f"{self.metric} <= {self.max:g}"] if self.max is not None else []
        return " and ".join(parts)

    def breach(self, values: Sequence[float | None]) -> str | None:
        """Why the constraint does not hold over ``values`` (one per run), or None."""
        known = sorted(v for v in values if v is not None)
        if not known or 2 * len(known) < len(values):
            return (
                f"cannot show {self.describe()}: {len(values) - len(known)} of "
                f"{len(values)} runs without a value that gives a verdict"
            )
        m = statistics.median(known)
        if (self.max is not None and m > self.max) or (self.min is not None and m < self.min):
            return f"breaks {self.describe()}: median {m:.4g} over {len(known)} runs"
        return None
