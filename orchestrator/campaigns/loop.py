"""The campaign loop as a state machine: which runs to do next, and what they decided.

A :class:`Campaign` walks from the starting configuration by **rounds**. A round measures
the incumbent's one-variable neighbours (:func:`~orchestrator.campaigns.space.neighbours`),
in the order an ``order`` hook gives (the advisor's evidence; it may also skip a candidate
with a reason), **interleaved** with the incumbent: each **cycle** runs the incumbent once,
then every candidate still measured, on the same request list, and each candidate's pair of
that cycle is ``(incumbent run, candidate run)``. After ``min_repeats`` cycles each
candidate is judged (:func:`~orchestrator.campaigns.decision.judge`) after every cycle: it
stops when its verdict is final (``pays``, ``worse``, ``inert``), when
:func:`~orchestrator.campaigns.decision.needs_more` says no more repeats can change it, or
when it can no longer beat the round's best paying candidate (its upper bound below that
one's lower bound). When none is left the round adopts **at most one** change, the paying
candidate with the largest estimate, and the next round starts from it; the campaign stops
when a round adopts nothing or the budget is spent.

**Side by side**: with ``slots`` server slots measuring at once (devices for that many runs,
each on its own, and a dispatcher that runs them together), a cycle whose configurations
each have a slot plans up to ``min_repeats`` pairs at once, each configuration's runs in a
row so that one server serves them (the pair ``k`` of every configuration measured at the
same time on other devices, instead of one after another), and the confirmation all its
pairs at once; the candidates are judged when the whole cycle is in. One slot: one pair a
cycle, interleaved.

A pair of configurations is compared once: a candidate whose two configurations (incumbent
and candidate) were already compared, such as the undoing of the step just adopted, is
skipped with that reason. A knob judged worse or inert is measured again in a later round
only because a different variable changed since (its incumbent is a different pair).

The **budget** is a number of runs. ``2 * max_repeats`` of them are reserved for the
**confirmation**, which runs the final configuration against the starting one, interleaved
(``max_repeats`` pairs), and reports the measured total next to the sum of the step gains
(log gains add; their difference is the interaction between the steps). Candidates the
budget leaves unmeasured end ``unknown``; so do those cut by ``max_device_s`` or
``max_wall_s`` (:class:`CostBudget`: the runs left at the mean cost per run so far).

A run **lost to the infrastructure** (its orchestrator, supervisor or node died: recorded
with ``lost``) says nothing of its configuration: the same run (role, configuration,
cycle) is planned again under the first label with ``.retry1``, ``.retry2``, at most
``max_retries`` times, each counted against the budget (a round's retry only while the
confirmation's reserve stays whole). The retries are planned when the cycle's last run is
recorded, in the cycle's order: which runs are measured again depends on what was recorded,
never on the order it was. A run lost past that, or with no room left, counts
as not measured: its candidate ends ``unknown`` (an incumbent's cycle gives no pair). A
run that failed (``None`` and not lost: the configuration's fault) ends its candidate
``failed``.

The state is a pure function of the recorded runs: constructing a campaign with the runs
recorded so far (``recorded``) replays them, so a restarted service rebuilds it from its
database and goes on with the same run labels (a label is the idempotency key of a run; no
run is lost or repeated). The ``order`` hook must therefore be deterministic.

Pure: no database, no Ray, no HTTP.

Size: about 660 lines of one state machine (rounds, cycles, retries of lost runs, budgets,
the confirmation) over one shared state; split, each part would take the whole state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from orchestrator.campaigns.decision import (
    DecisionRule,
    Direction,
    Gain,
    Verdict,
    gain_from_pairs,
    judge,
    needs_more,
    sum_gains,
)
from orchestrator.campaigns.outcomes import (
    CandidateResult,
    Confirmation,
    Constraint,
    CostBudget,
    OrderHook,
    Outcome,
    Phase,
    PlannedRun,
    Recorded,
    Role,
    Step,
    Triage,
)
from orchestrator.campaigns.space import (
    Candidate,
    Config,
    ConfigKey,
    Level,
    Space,
    config_key,
    neighbours,
)

#: What happened to a run recorded ``lost`` when nothing else is said.
LOST = "lost to the infrastructure"
#: How many times a run lost to the infrastructure is measured again, at most.
MAX_RETRIES = 2


@dataclass
class _Arm:
    candidate: Candidate
    config: dict[str, Level]
    values: dict[int, float | None] = field(default_factory=dict)
    checks: dict[int, Mapping[str, float | None]] = field(default_factory=dict)
    live: bool = True
    gain: Gain | None = None
    verdict: Verdict | None = None
    outcome: Outcome | None = None
    reason: str = ""


@dataclass
class _Round:
    index: int
    incumbent: dict[str, Level]
    arms: list[_Arm]
    results: list[CandidateResult] = field(default_factory=list)
    incumbent_values: dict[int, float | None] = field(default_factory=dict)
    cycle: int = 0
    ended: bool = False


#: Pairs a side-by-side cycle adds after a round's first: more pairs at once start fewer
#: servers but judge later, spending runs past a verdict (on the response surface of
#: docs/BENCHMARKS.md: 1 pair: 57.5 starts on average, 2: 51.8, 3: 48.8 with 2 of 50
#: campaigns short of the optimum).
LATER_PAIRS = 2


class Campaign:
    """A tuning campaign's decisions (see the module docstring).

    ``space`` the variables, ``start`` the starting configuration (every variable at one of
    its levels), ``rule`` the decision rule, ``budget`` the most runs in all (confirmation
    included), ``recorded`` the runs recorded so far in the order they were recorded,
    ``order`` the hook that orders (and may skip) each round's candidates, ``direction``
    the objective's, ``max_retries`` how many times a run lost to the infrastructure is
    measured again. Raises ``ValueError`` on a start outside the space, a budget too small
    to confirm, a recorded run that was not planned, or a hook that drops or adds a
    candidate.
    """

    def __init__(
        self,
        space: Space,
        start: Config,
        rule: DecisionRule,
        budget: int,
        recorded: Iterable[Recorded] = (),
        order: OrderHook | None = None,
        direction: Direction = Direction.HIGHER,
        max_retries: int = MAX_RETRIES,
        constraints: Sequence[Constraint] = (),
        max_device_s: float | None = None,
        max_wall_s: float | None = None,
        slots: int = 1,
    ) -> None:
        space.check(start)
        self.constraints = tuple(constraints)
        self.device = CostBudget("device-hour budget", max_device_s)
        self.wall = CostBudget("wall-time budget", max_wall_s, clock=True)
        self.slots = max(1, slots)  # server slots measuring at once (side by side)
        self.space, self.rule, self.budget, self.direction = space, rule, budget, direction
        self.start: dict[str, Level] = dict(start)
        self.incumbent: dict[str, Level] = dict(start)
        self.reserve = 2 * rule.max_repeats
        if budget < self.reserve + 2:
            raise ValueError(
                f"a budget of {budget} runs leaves no room: the confirmation takes "
                f"{self.reserve} and a round at least 2"
            )
        self._order = order
        self.max_retries = max_retries
        self.phase = Phase.ROUNDS
        self.runs_used = 0
        self._rounds: list[_Round] = []
        self._steps: list[Step] = []
        self._compared: dict[frozenset[ConfigKey], tuple[int, Outcome]] = {}
        self._pending: dict[str, PlannedRun] = {}
        self._values: dict[str, float | None] = {}
        self._confirm_values: dict[int, tuple[float | None, float | None]] = {}
        self._lost: list[str] = []  # lost runs of the cycle, not decided yet
        self._retries: dict[str, str] = {}  # a lost run's label -> its retry's
        self._unmeasured: dict[str, str] = {}  # a lost run not retried -> why
        self._lost_why: dict[str, str] = {}  # a lost run -> what happened to it
        self._checks: dict[str, Mapping[str, float | None]] = {}  # constraints' metrics
        self._open_round()
        for run in recorded:
            self.record(
                run.label,
                run.value,
                run.lost,
                run.why,
                run.checks,
                run.device_s,
                run.ended_s,
                run.again,
            )

    # ----------------------------------------------------------------- the executor's side

    def next_runs(self) -> list[PlannedRun]:
        """The runs of the current cycle not recorded yet, in the order to run them
        (interleaved: the incumbent first); empty once the campaign is done."""
        return [run for label, run in self._pending.items() if label not in self._values]

    def record(
        self,
        label: str,
        value: float | None,
        lost: bool = False,
        why: str | None = None,
        checks: Mapping[str, float | None] | None = None,
        device_s: float | None = None,
        ended_s: float | None = None,
        again: bool = True,
    ) -> None:
        """Record the objective of a planned run (``None``: the run failed; ``lost``: it
        measured nothing usable, and is planned again unless ``again`` is False (measuring
        it again would give the same: a search that found its boundary outside the range,
        no energy counter): see the module docstring; ``why``:
        what happened to it, "lost to the infrastructure" unless said, such as a
        measurement a finding flagged; ``checks``: the run's values of the constraints'
        metrics, ``None`` where it has none that gives a verdict; ``device_s``: the
        device-seconds it held; ``ended_s``: when it ended, seconds after the campaign began).

        The runs of one cycle may be recorded in any order; when its last run is, its lost
        runs are planned again (in the cycle's order, so the order they were recorded in
        never decides which one the budget's last room goes to) and the cycle waits for
        them; it is judged once every run is recorded and none is to be measured again.
        Raises ``ValueError`` on a label that is not pending (unknown, or
        already recorded), a value that is not a positive finite number, or a lost run
        with a value.
        """
        if label not in self._pending or label in self._values:
            raise ValueError(f"run {label!r} is not pending in this campaign")
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"run {label!r}: the objective must be positive, got {value!r}")
        if lost and value is not None:
            raise ValueError(f"run {label!r}: a run lost to the infrastructure has no value")
        self._values[label] = value
        self._checks[label] = dict(checks or {})
        self.runs_used += 1
        self.device.add(device_s)
        self.wall.add(ended_s)
        if lost:
            self._lost.append(label)
            self._lost_why[label] = why or LOST
            if not again:
                self._unmeasured[label] = (
                    f"run {label} was {why or LOST}, which measuring it again would not "
                    "change; not measured again"
                )
        if len(self._values) < len(self._pending):
            return
        lost_runs = [run for run in self._pending.values() if run.label in self._lost]
        self._lost = []
        for run in lost_runs:
            self._retry(run)
        if len(self._values) == len(self._pending):
            if self.phase is Phase.ROUNDS:
                self._close_cycle()
            else:
                self._close_confirm_cycle()

    def _retry(self, run: PlannedRun) -> None:
        """Plan ``run`` (lost to the infrastructure) again, or say why it is not."""
        if run.label in self._unmeasured:  # recorded as not worth measuring again
            return
        cap = self.budget if self.phase is Phase.CONFIRMING else self.budget - self.reserve
        waiting = sum(1 for label in self._pending if label not in self._values)  # retries
        if run.attempt >= self.max_retries:
            times = run.attempt + 1
            self._unmeasured[run.label] = (
                f"run {run.label} was {self._lost_why[run.label]} {times} times; not measured"
            )
            return
        if self.runs_used + waiting + 1 > cap:
            self._unmeasured[run.label] = (
                f"run {run.label} was {self._lost_why[run.label]} and the budget leaves no "
                "room to measure it again"
            )
            return
        keep = 0 if self.phase is Phase.CONFIRMING else self.reserve
        for cost in (self.device, self.wall):
            left = cost.runs_left()
            if left is not None and waiting + 1 > left - keep:
                self._unmeasured[run.label] = (
                    f"run {run.label} was {self._lost_why[run.label]} and the {cost.name} "
                    "leaves no room to measure it again"
                )
                return
        first = run.label.removesuffix(f".retry{run.attempt}") if run.attempt else run.label
        retry = dataclasses.replace(
            run, label=f"{first}.retry{run.attempt + 1}", attempt=run.attempt + 1
        )
        self._retries[run.label] = retry.label
        self._pending[retry.label] = retry

    # ----------------------------------------------------------------- results

    def retries(self) -> dict[str, str]:
        """The runs lost to the infrastructure and measured again: label -> the retry's."""
        return dict(self._retries)

    def unmeasured(self) -> dict[str, str]:
        """The runs lost to the infrastructure and not measured again: label -> why."""
        return dict(self._unmeasured)

    def path(self) -> list[Step]:
        """The adopted steps, in order."""
        return list(self._steps)

    def candidates(self) -> list[CandidateResult]:
        """Every candidate of every round (the round in progress too: ``measuring``, or
        how it ended when it ended early)."""
        rows: list[CandidateResult] = []
        for rnd in self._rounds:
            rows.extend(rnd.results)
            if rnd.ended:
                continue
            for arm in rnd.arms:  # those that ended early (failed, lost...) say so already
                outcome = arm.outcome if arm.outcome is not None else Outcome.MEASURING
                rows.append(_result(rnd.index, arm, outcome, _pairs(rnd, arm)))
        return rows

    def cumulative(self) -> Gain | None:
        """The sum of the step gains (the path's total as the steps measured it)."""
        return sum_gains([s.gain for s in self._steps]) if self._steps else None

    def confirmed(self) -> Confirmation | None:
        """The confirmation once it has at least 2 pairs and the campaign is done."""
        pairs = [
            (s, f) for s, f in self._confirm_values.values() if s is not None and f is not None
        ]
        steps = self.cumulative()
        if self.phase is not Phase.DONE or len(pairs) < 2 or steps is None:
            return None
        total = gain_from_pairs(pairs, self.rule.confidence, self.direction)
        interaction = sum_gains([total, steps], sign=(1.0, -1.0))
        return Confirmation(
            total=total,
            steps=steps,
            interaction=interaction,
            agrees=interaction.low <= 0 <= interaction.high,
        )

    # ----------------------------------------------------------------- rounds

    def _open_round(self) -> None:
        index = len(self._rounds) + 1
        incumbent = dict(self.incumbent)
        rnd = _Round(index=index, incumbent=incumbent, arms=[])
        self._rounds.append(rnd)
        skipped: list[CandidateResult] = []
        fresh: list[Candidate] = []
        for cand in neighbours(incumbent, self.space):
            seen = self._compared.get(_pair_key(incumbent, cand.apply(incumbent)))
            if seen is None:
                fresh.append(cand)
                continue
            k, outcome = seen
            why = (
                f"undoes the step adopted in round {k}"
                if outcome is Outcome.ADOPTED
                else f"the same two configurations were compared in round {k} ({outcome})"
            )
            skipped.append(_skip(index, cand, why))
        for triage in self._triage(incumbent, fresh):
            if triage.skip is not None:
                skipped.append(_skip(index, triage.candidate, triage.skip))
            else:
                cand = triage.candidate
                rnd.arms.append(_Arm(candidate=cand, config=cand.apply(incumbent)))
        rnd.results.extend(skipped)
        if not rnd.arms:
            rnd.ended = True
            self._finish_rounds()
            return
        self._open_cycle(rnd)

    def _triage(self, incumbent: Config, fresh: list[Candidate]) -> list[Triage]:
        if self._order is None:
            return [Triage(c) for c in fresh]
        ordered = list(self._order(incumbent, list(fresh)))
        got = sorted(t.candidate.label for t in ordered)
        want = sorted(c.label for c in fresh)
        if got != want:
            raise ValueError(
                f"the order hook must return every candidate once: got {got}, expected {want}"
            )
        return ordered

    def _open_cycle(self, rnd: _Round) -> None:
        live = [arm for arm in rnd.arms if arm.live]
        room, which = self.budget - self.reserve - self.runs_used - 1, "budget"
        for cost in (self.device, self.wall):
            left = cost.runs_left()
            if left is not None and left - self.reserve - 1 < room:
                room, which = left - self.reserve - 1, cost.name
        for arm in live[max(room, 0) :]:
            n = _pairs(rnd, arm)
            arm.live, arm.outcome = False, Outcome.UNKNOWN
            arm.reason = f"the {which} ran out after {n} pair{'s' if n != 1 else ''}"
        live = live[: max(room, 0)]
        if not live:
            self._end_round(rnd)
            return
        done = max(_pairs(rnd, arm) for arm in live)
        cycles = [rnd.cycle + k + 1 for k in range(self._together(1 + len(live), done, room))]
        rnd.cycle = cycles[-1]
        runs = [
            self._plan(f"r{rnd.index}.c{c}.incumbent", rnd.incumbent, Role.INCUMBENT, rnd, None, c)
            for c in cycles
        ]
        runs += [
            self._plan(
                f"r{rnd.index}.c{c}.{arm.candidate.label}", arm.config, Role.CANDIDATE, rnd, arm, c
            )
            for arm in live
            for c in cycles
        ]
        self._pending = {run.label: run for run in runs}
        self._values = {}

    def _together(self, configs: int, done: int, room: int) -> int:
        """Pairs planned at once: 1 (the configurations interleaved on one server slot)
        unless each of the ``configs`` has a slot of its own; then side by side,
        ``min_repeats`` pairs in a round's first cycle and :data:`LATER_PAIRS` after it (no
        more than ``max_repeats`` less the ``done`` ones, nor than the budget's ``room``
        affords), each configuration's runs in a row on its server."""
        if self.slots < configs:
            return 1
        first = self.rule.min_repeats if done == 0 else LATER_PAIRS
        want = min(first, self.rule.max_repeats - done)
        return max(1, min(want, (room + 1) // configs))

    def _plan(
        self,
        label: str,
        config: dict[str, Level],
        role: Role,
        rnd: _Round,
        arm: _Arm | None,
        cycle: int,
    ) -> PlannedRun:
        return PlannedRun(
            label=label,
            config=dict(config),
            role=role,
            round=rnd.index,
            cycle=cycle,
            candidate=arm.candidate if arm is not None else None,
            server_key=self.space.server_key(config),
        )

    def _close_cycle(self) -> None:
        rnd = self._rounds[-1]
        for run in self._measured():
            value, c = self._values[run.label], run.cycle
            if run.role is Role.INCUMBENT:
                rnd.incumbent_values[c] = value
                continue
            arm = next(a for a in rnd.arms if a.candidate == run.candidate)
            arm.values[c] = value
            arm.checks[c] = self._checks.get(run.label, {})
            if value is None and run.label in self._unmeasured:
                arm.live, arm.outcome = False, Outcome.UNKNOWN
                arm.reason = self._unmeasured[run.label]
            elif value is None:
                arm.live, arm.outcome = False, Outcome.FAILED
                arm.reason = f"run {run.label} failed"
        for arm in rnd.arms:
            if arm.live:
                self._judge_arm(rnd, arm)
        self._stop_outpaid(rnd)
        if any(arm.live for arm in rnd.arms):
            self._open_cycle(rnd)
        else:
            self._end_round(rnd)

    def _measured(self) -> list[PlannedRun]:
        """The cycle's runs that stand for their (role, configuration): the last try of
        each (a run lost and measured again stands for nothing)."""
        return [run for run in self._pending.values() if run.label not in self._retries]

    def _judge_arm(self, rnd: _Round, arm: _Arm) -> None:
        pairs = _pair_values(rnd, arm)
        if len(pairs) < max(self.rule.min_repeats, 2):
            return
        arm.gain = gain_from_pairs(pairs, self.rule.confidence, self.direction)
        arm.verdict = judge(arm.gain, self.rule)
        if not needs_more(arm.gain, self.rule, len(pairs)):
            arm.live = False

    def _mark_infeasible(self, rnd: _Round) -> None:
        """A paying candidate whose constraint does not hold on its runs so far (or cannot be
        shown to) ends ``infeasible`` and stops: it is never adopted nor outpays another."""
        for arm in rnd.arms:
            if arm.verdict is not Verdict.PAYS or arm.outcome is not None:
                continue
            cycles = [c for c, v in arm.values.items() if v is not None]
            for constraint in self.constraints:
                values = [arm.checks.get(c, {}).get(constraint.metric) for c in cycles]
                why = constraint.breach(values)
                if why is not None:
                    arm.live, arm.outcome, arm.reason = False, Outcome.INFEASIBLE, why
                    break

    def _stop_outpaid(self, rnd: _Round) -> None:
        self._mark_infeasible(rnd)
        paying = [a for a in rnd.arms if a.verdict is Verdict.PAYS and a.outcome is None]
        if not paying:
            return
        best = max(paying, key=lambda a: _low(a.gain))
        for arm in rnd.arms:
            if arm.live and arm.gain is not None and arm.gain.high < _low(best.gain):
                arm.live, arm.outcome = False, Outcome.OUTPAID
                arm.reason = (
                    f"cannot beat {best.candidate.label}: its upper bound "
                    f"{math.expm1(arm.gain.high):+.1%} is below that one's lower bound "
                    f"{math.expm1(_low(best.gain)):+.1%}"
                )

    def _end_round(self, rnd: _Round) -> None:
        self._mark_infeasible(rnd)
        paying = [a for a in rnd.arms if a.verdict is Verdict.PAYS and a.outcome is None]
        best = max(paying, key=lambda a: a.gain.estimate if a.gain else 0.0, default=None)
        rnd.ended = True
        for arm in rnd.arms:
            outcome = self._settle(rnd, arm, best)
            rnd.results.append(_result(rnd.index, arm, outcome, _pairs(rnd, arm)))
            if outcome is not Outcome.UNKNOWN:
                key = _pair_key(rnd.incumbent, arm.config)
                self._compared[key] = (rnd.index, outcome)
        if best is None or best.gain is None:
            self._finish_rounds()
            return
        self._steps.append(
            Step(
                round=rnd.index,
                variable=best.candidate.variable,
                from_level=best.candidate.from_level,
                to_level=best.candidate.to_level,
                gain=best.gain,
                verdict=Verdict.PAYS,
                reason=best.reason,
            )
        )
        self.incumbent = dict(best.config)
        self._open_round()

    def _settle(self, rnd: _Round, arm: _Arm, best: _Arm | None) -> Outcome:
        """Set the arm's final outcome and reason at the end of its round."""
        rule = self.rule
        if arm.outcome is not None:
            return arm.outcome
        gain = arm.gain.describe() if arm.gain else "no interval"
        n = _pairs(rnd, arm)
        if arm is best:
            arm.outcome = Outcome.ADOPTED
            arm.reason = f"pays {gain}: above +{rule.min_gain:.1%}, the best of round {rnd.index}"
        elif arm.verdict is Verdict.PAYS and best is not None:
            arm.outcome = Outcome.OUTPAID
            arm.reason = f"pays {gain}, less than {best.candidate.label}"
        elif arm.verdict is Verdict.WORSE:
            arm.outcome, arm.reason = Outcome.WORSE, f"worse {gain}"
        elif arm.verdict is Verdict.INERT:
            arm.outcome = Outcome.INERT
            arm.reason = f"equivalent within +-{rule.equivalence_margin:.1%}: {gain}"
        elif arm.verdict is Verdict.MARGINAL:
            arm.outcome = Outcome.MARGINAL
            arm.reason = f"a real gain {gain}, not shown to reach +{rule.min_gain:.1%}"
        else:
            arm.outcome = Outcome.UNDECIDED
            arm.reason = f"no verdict after {n} pairs: {gain}"
        return arm.outcome

    def _finish_rounds(self) -> None:
        if config_key(self.incumbent) == config_key(self.start):
            self._done()
            return
        self.phase = Phase.CONFIRMING
        self._open_confirm_cycle()

    # ----------------------------------------------------------------- confirmation

    def _open_confirm_cycle(self) -> None:
        first = len(self._confirm_values) + 1
        left = min(self.rule.max_repeats - first + 1, (self.budget - self.runs_used) // 2)
        if left < 1:
            self._done()
            return
        together = left if self.slots >= 2 else 1  # side by side: every pair at once
        runs = [
            PlannedRun(
                label=f"confirm.c{c}.{role}",
                config=dict(config),
                role=role,
                round=0,
                cycle=c,
                candidate=None,
                server_key=self.space.server_key(config),
            )
            for role, config in ((Role.START, self.start), (Role.FINAL, self.incumbent))
            for c in range(first, first + together)
        ]
        self._pending = {run.label: run for run in runs}
        self._values = {}

    def _close_confirm_cycle(self) -> None:
        values: dict[int, dict[Role, float | None]] = {}
        for run in self._measured():
            values.setdefault(run.cycle, {})[run.role] = self._values[run.label]
        for c in sorted(values):
            self._confirm_values[c] = (values[c][Role.START], values[c][Role.FINAL])
        self._open_confirm_cycle()

    def _done(self) -> None:
        self.phase = Phase.DONE
        self._pending = {}
        self._values = {}


def _pair_key(a: Config, b: Config) -> frozenset[ConfigKey]:
    return frozenset((config_key(a), config_key(b)))


def _pair_values(rnd: _Round, arm: _Arm) -> list[tuple[float, float]]:
    pairs: list[tuple[float, float]] = []
    for c, value in sorted(arm.values.items()):
        inc = rnd.incumbent_values.get(c)
        if inc is not None and value is not None:
            pairs.append((inc, value))
    return pairs


def _pairs(rnd: _Round, arm: _Arm) -> int:
    return len(_pair_values(rnd, arm))


def _low(gain: Gain | None) -> float:
    return gain.low if gain is not None else -math.inf


def _skip(index: int, cand: Candidate, reason: str) -> CandidateResult:
    return CandidateResult(
        round=index,
        candidate=cand,
        outcome=Outcome.SKIPPED,
        verdict=None,
        gain=None,
        pairs=0,
        reason=reason,
    )


def _result(index: int, arm: _Arm, outcome: Outcome, pairs: int) -> CandidateResult:
    return CandidateResult(
        round=index,
        candidate=arm.candidate,
        outcome=outcome,
        verdict=arm.verdict,
        gain=arm.gain,
        pairs=pairs,
        reason=arm.reason,
    )
