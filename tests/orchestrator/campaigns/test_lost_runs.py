"""Runs lost to the infrastructure are measured again, not counted as the candidate's
failure; a run that failed (the configuration's fault) stays a failure."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.campaigns.decision import DecisionRule
from orchestrator.campaigns.loop import MAX_RETRIES, Campaign
from orchestrator.campaigns.outcomes import Outcome, Phase, PlannedRun, Recorded, Role
from orchestrator.campaigns.space import Level, Space, Variable

A = "engine_args.enable_prefix_caching"
S = "engine_args.max_num_seqs"
SPACE = Space(variables=(Variable.boolean(A), Variable(name=S, levels=(1, 2, 3))))
START: dict[str, Level] = {A: False, S: 2}
RULE = DecisionRule()
EFFECTS = {(A, True): 1.30, (S, 1): 0.80, (S, 3): 1.10}

#: What a measurement says: the objective, ``None`` (failed), or ``LOST``.
LOST = "lost"
Measured = float | None | str


def _surface(seed: int = 0) -> Callable[[PlannedRun], float]:
    rng = random.Random(seed)

    def measure(run: PlannedRun) -> float:
        value = 100.0
        for (name, level), factor in EFFECTS.items():
            if run.config.get(name) == level and type(run.config[name]) is type(level):
                value *= factor
        return value * math.exp(rng.gauss(0.0, 0.005))

    return measure


def _drive(
    campaign: Campaign, measure: Callable[[PlannedRun], Measured]
) -> tuple[list[PlannedRun], list[Recorded]]:
    done: list[PlannedRun] = []
    recorded: list[Recorded] = []
    while batch := campaign.next_runs():
        for run in batch:
            got = measure(run)
            rec = (
                Recorded(run.label, None, lost=True)
                if got == LOST
                else Recorded(run.label, got if isinstance(got, float) else None)
            )
            campaign.record(rec.label, rec.value, rec.lost)
            done.append(run)
            recorded.append(rec)
    return done, recorded


def _losing(labels: set[str], seed: int = 0) -> Callable[[PlannedRun], Measured]:
    measure = _surface(seed)

    def run(planned: PlannedRun) -> Measured:
        return LOST if planned.label in labels else measure(planned)

    return run


def test_a_lost_candidate_run_is_measured_again_under_a_retry_label() -> None:
    lost = f"r1.c1.{S}=3"
    campaign = Campaign(SPACE, START, RULE, budget=200)
    runs, _ = _drive(campaign, _losing({lost}))
    retry = next(r for r in runs if r.label == f"{lost}.retry1")
    first = next(r for r in runs if r.label == lost)
    # the same role, configuration, round and cycle: only the label and attempt differ
    assert (retry.role, retry.config, retry.round, retry.cycle, retry.candidate) == (
        first.role,
        first.config,
        first.round,
        first.cycle,
        first.candidate,
    )
    assert (first.attempt, retry.attempt) == (0, 1)
    # measured in the cycle it belongs to: after the cycle's other runs, before cycle 2
    labels = [r.label for r in runs]
    assert labels.index(f"{lost}.retry1") < labels.index("r1.c2.incumbent")
    assert campaign.retries() == {lost: f"{lost}.retry1"}
    # its candidate is judged on its pairs as if nothing was lost
    rows = {r.candidate.label: r for r in campaign.candidates() if r.round == 1}
    assert rows[f"{S}=3"].outcome is Outcome.OUTPAID and rows[f"{S}=3"].pairs == 3
    assert not any(r.outcome is Outcome.FAILED for r in campaign.candidates())
    # the lost run counts against the budget
    assert campaign.runs_used == len(runs)
    assert campaign.incumbent == {A: True, S: 3}


def test_a_run_failed_by_its_configuration_stays_a_failure() -> None:
    measure = _surface()
    campaign = Campaign(SPACE, START, RULE, budget=200)
    runs, _ = _drive(campaign, lambda r: None if r.config[S] == 1 else measure(r))
    assert not any(".retry" in r.label for r in runs)
    failed = [r for r in campaign.candidates() if r.outcome is Outcome.FAILED]
    assert {r.candidate.label for r in failed} == {f"{S}=1"}
    assert campaign.retries() == {}


def test_a_run_lost_past_the_retries_leaves_its_candidate_unknown_not_failed() -> None:
    base = f"r1.c1.{S}=1"
    chain = {base} | {f"{base}.retry{k}" for k in range(1, MAX_RETRIES + 1)}
    campaign = Campaign(SPACE, START, RULE, budget=200)
    runs, _ = _drive(campaign, _losing(chain))
    assert [r.label for r in runs if r.label.startswith(base)] == sorted(chain)
    assert f"{base}.retry{MAX_RETRIES + 1}" not in {r.label for r in runs}
    row = next(r for r in campaign.candidates() if r.round == 1 and r.candidate.label == f"{S}=1")
    assert row.outcome is Outcome.UNKNOWN
    assert row.reason == (
        f"run {base}.retry{MAX_RETRIES} was lost to the infrastructure "
        f"{MAX_RETRIES + 1} times; not measured"
    )
    assert campaign.unmeasured() == {f"{base}.retry{MAX_RETRIES}": row.reason}


def test_a_lost_incumbent_and_a_lost_confirmation_run_are_measured_again() -> None:
    lost = {"r1.c2.incumbent", "confirm.c1.start", "confirm.c1.start.retry1"}
    campaign = Campaign(SPACE, START, RULE, budget=200)
    runs, _ = _drive(campaign, _losing(lost))
    labels = [r.label for r in runs]
    assert "r1.c2.incumbent.retry1" in labels and "r1.c3.incumbent" in labels
    assert labels.index("confirm.c1.start.retry2") < labels.index("confirm.c2.start")
    retry = next(r for r in runs if r.label == "confirm.c1.start.retry2")
    assert (retry.role, retry.round, retry.cycle, retry.config) == (Role.START, 0, 1, START)
    confirmed = campaign.confirmed()
    assert campaign.phase is Phase.DONE and confirmed is not None
    assert confirmed.total.n == RULE.max_repeats  # no confirmation pair was lost
    assert campaign.runs_used == len(runs) == len(set(labels))


def test_a_retry_never_eats_the_confirmations_reserve() -> None:
    """A round's lost run with no room left before the reserve is not measured again:
    its candidate ends unknown, and the confirmation still gets its runs."""
    budget = 2 * RULE.max_repeats + 8  # rounds: 8 runs, two cycles of 4

    measure = _surface()
    campaign = Campaign(SPACE, START, RULE, budget=budget)
    runs, _ = _drive(campaign, lambda r: LOST if r.label == f"r1.c2.{S}=1" else measure(r))
    assert f"r1.c2.{S}=1.retry1" not in {r.label for r in runs}
    row = next(r for r in campaign.candidates() if r.candidate.label == f"{S}=1")
    assert row.outcome is Outcome.UNKNOWN
    assert "the budget leaves no room to measure it again" in row.reason
    assert campaign.runs_used <= budget


def test_a_campaign_with_lost_runs_replays_to_the_same_state() -> None:
    """Replay stays a pure function of the recorded runs, lost ones included."""
    rng = random.Random(11)
    measure = _surface(5)
    original = Campaign(SPACE, START, RULE, budget=200)
    recorded: list[Recorded] = []
    pending: list[list[str]] = [[r.label for r in original.next_runs()]]
    while batch := original.next_runs():
        run = batch[0]
        rec = (
            Recorded(run.label, None, lost=True)
            if rng.random() < 0.15
            else Recorded(run.label, measure(run))
        )
        original.record(rec.label, rec.value, rec.lost)
        recorded.append(rec)
        pending.append([r.label for r in original.next_runs()])
    assert any(r.lost for r in recorded) and original.retries()
    for cut in range(len(recorded) + 1):
        rebuilt = Campaign(SPACE, START, RULE, budget=200, recorded=recorded[:cut])
        assert [r.label for r in rebuilt.next_runs()] == pending[cut]
        assert rebuilt.runs_used == cut
    assert rebuilt.phase is Phase.DONE
    assert rebuilt.candidates() == original.candidates()
    assert rebuilt.path() == original.path()
    assert rebuilt.retries() == original.retries()
    assert rebuilt.unmeasured() == original.unmeasured()


def test_a_lost_run_has_no_value() -> None:
    campaign = Campaign(SPACE, START, RULE, budget=100)
    with pytest.raises(ValueError, match="lost to the infrastructure has no value"):
        campaign.record("r1.c1.incumbent", 100.0, lost=True)


def test_the_order_runs_are_recorded_in_never_decides_which_is_measured_again() -> None:
    """Two runs of a cycle lost, room for one retry: the cycle's first gets it, whichever
    was recorded first (a service that saw the other lost first decides the same)."""
    budget = 2 * RULE.max_repeats + 5  # rounds: a cycle of 4 and one run more
    first, second = f"r1.c1.{S}=1", f"r1.c1.{S}=3"
    cycles = []
    for order in ((first, second), (second, first)):
        campaign = Campaign(SPACE, START, RULE, budget=budget)
        cycle = {r.label: r for r in campaign.next_runs()}
        for label in [label for label in cycle if label not in order] + list(order):
            lost = label in order
            campaign.record(label, None if lost else 100.0, lost=lost)
            if label != order[-1]:
                assert campaign.retries() == {}  # nothing decided before the cycle's end
        cycles.append((campaign.retries(), campaign.unmeasured(), campaign.next_runs()))
    assert cycles[0] == cycles[1]
    retries, unmeasured, waiting = cycles[0]
    assert retries == {first: f"{first}.retry1"}
    assert list(unmeasured) == [second]
    assert [r.label for r in waiting] == [f"{first}.retry1"]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    budget=st.integers(2 * RULE.max_repeats + 2, 200),
    loss=st.sampled_from([0.05, 0.2, 0.5]),
)
def test_any_campaign_with_lost_runs_keeps_its_budget_and_fails_no_candidate(
    seed: int, budget: int, loss: float
) -> None:
    rng = random.Random(seed)
    measure = _surface(seed)
    campaign = Campaign(SPACE, START, RULE, budget=budget)
    runs, recorded = _drive(campaign, lambda r: LOST if rng.random() < loss else measure(r))
    assert campaign.phase is Phase.DONE
    assert campaign.runs_used == len(runs) <= budget
    assert len({r.label for r in runs}) == len(runs)
    lost = {r.label for r in recorded if r.lost}
    # every lost run was measured again or said why not; every retry is of a lost run
    assert set(campaign.retries()) | set(campaign.unmeasured()) == lost
    assert not set(campaign.retries()) & set(campaign.unmeasured())
    by_label = {r.label: r for r in runs}
    for label, retry in campaign.retries().items():
        a, b = by_label[label], by_label[retry]
        assert (a.role, a.config, a.round, a.cycle) == (b.role, b.config, b.round, b.cycle)
        assert b.attempt == a.attempt + 1 <= MAX_RETRIES
    assert all(r.outcome is not Outcome.FAILED for r in campaign.candidates())
    # the rounds' retries never ate the confirmation's reserve (its own retries may)
    assert sum(1 for r in runs if r.round > 0) <= budget - 2 * RULE.max_repeats
    rebuilt = Campaign(SPACE, START, RULE, budget=budget, recorded=recorded)
    assert rebuilt.candidates() == campaign.candidates()
    assert rebuilt.confirmed() == campaign.confirmed()


def test_a_spent_wall_time_budget_measures_no_lost_run_again() -> None:
    """Runs end 60 s apart and the wall-time budget is 100 s: the first cycle spends it,
    so its lost run is not measured again (a fresh-user trial saw retries queued after
    the wall-time budget ran out); the reason names the budget."""
    campaign = Campaign(SPACE, START, RULE, budget=200, max_wall_s=100.0)
    first = campaign.next_runs()
    measure = _surface()
    for i, run in enumerate(first, start=1):
        lost = run is first[-1]
        campaign.record(run.label, None if lost else measure(run), lost, ended_s=60.0 * i)
    assert not any(".retry" in r.label for r in campaign.next_runs())
    assert any(
        "the wall-time budget leaves no room to measure it again" in why
        for why in campaign.unmeasured().values()
    ), campaign.unmeasured()
