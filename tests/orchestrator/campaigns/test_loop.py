"""The campaign loop: interleaved cycles, rounds, adoption, budget, confirmation, replay."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.campaigns.decision import DecisionRule, Direction, Verdict
from orchestrator.campaigns.loop import Campaign
from orchestrator.campaigns.outcomes import (
    Constraint,
    Outcome,
    Phase,
    PlannedRun,
    Recorded,
    Role,
    Triage,
    server_starts,
)
from orchestrator.campaigns.space import Candidate, Config, Level, Space, Variable
from tests.orchestrator.campaigns import surface

A = "engine_args.enable_prefix_caching"
S = "engine_args.max_num_seqs"
RATE = "workload.request_rate"
SPACE = Space(variables=(Variable.boolean(A), Variable(name=S, levels=(1, 2, 3))))
START: dict[str, Level] = {A: False, S: 2}
RULE = DecisionRule()

#: Multiplicative effect of each (variable, level) on the objective; missing is x1.
Effects = Mapping[tuple[str, Level], float]
CLIMB: Effects = {(A, True): 1.30, (S, 1): 0.80, (S, 3): 1.10}


def _measure(effects: Effects, sigma: float, seed: int = 0) -> Callable[[PlannedRun], float]:
    rng = random.Random(seed)

    def measure(run: PlannedRun) -> float:
        value = 100.0
        for key, factor in effects.items():
            if run.config.get(key[0]) == key[1] and type(run.config[key[0]]) is type(key[1]):
                value *= factor
        return value * math.exp(rng.gauss(0.0, sigma))

    return measure


def _drive(campaign: Campaign, measure: Callable[[PlannedRun], float | None]) -> list[PlannedRun]:
    done: list[PlannedRun] = []
    while batch := campaign.next_runs():
        for run in batch:
            campaign.record(run.label, measure(run))
            done.append(run)
    return done


def _rows(campaign: Campaign, round_: int) -> dict[str, tuple[Outcome, int]]:
    return {
        r.candidate.label: (r.outcome, r.pairs) for r in campaign.candidates() if r.round == round_
    }


def test_a_cycle_runs_the_incumbent_then_each_candidate() -> None:
    campaign = Campaign(SPACE, START, RULE, budget=100)
    runs = campaign.next_runs()
    assert [r.label for r in runs] == [
        "r1.c1.incumbent",
        "r1.c1.engine_args.enable_prefix_caching=true",
        "r1.c1.engine_args.max_num_seqs=1",
        "r1.c1.engine_args.max_num_seqs=3",
    ]
    assert [r.role for r in runs] == [Role.INCUMBENT] + [Role.CANDIDATE] * 3
    assert runs[0].config == START and runs[0].candidate is None
    assert runs[1].config == {A: True, S: 2}
    assert {(r.round, r.cycle) for r in runs} == {(1, 1)}
    # any order within a cycle; the next cycle opens when the last run is recorded
    for run in reversed(runs[1:]):
        campaign.record(run.label, 100.0)
    assert [r.label for r in campaign.next_runs()] == ["r1.c1.incumbent"]
    campaign.record("r1.c1.incumbent", 100.0)
    assert campaign.next_runs()[0].label == "r1.c2.incumbent"
    assert campaign.runs_used == 4


def test_record_refuses_what_was_not_planned() -> None:
    campaign = Campaign(SPACE, START, RULE, budget=100)
    with pytest.raises(ValueError, match="not pending"):
        campaign.record("r1.c2.incumbent", 100.0)
    campaign.record("r1.c1.incumbent", 100.0)
    with pytest.raises(ValueError, match="not pending"):
        campaign.record("r1.c1.incumbent", 100.0)
    for bad in (0.0, -3.0, math.nan):
        with pytest.raises(ValueError, match="must be positive"):
            campaign.record("r1.c1.engine_args.max_num_seqs=1", bad)


def test_the_loop_adopts_one_change_per_round_then_confirms() -> None:
    campaign = Campaign(SPACE, START, RULE, budget=200)
    runs = _drive(campaign, _measure(CLIMB, sigma=0.005))
    assert campaign.phase is Phase.DONE and campaign.next_runs() == []
    assert campaign.incumbent == {A: True, S: 3}
    path = campaign.path()
    assert [(s.round, s.variable, s.from_level, s.to_level) for s in path] == [
        (1, A, False, True),
        (2, S, 2, 3),
    ]
    assert all(s.verdict is Verdict.PAYS for s in path)
    assert path[0].gain.low > math.log(1.05)
    assert "the best of round 1" in path[0].reason
    # round 1: the gain of S=3 paid too, but less; S=1 worse after min_repeats
    assert _rows(campaign, 1) == {
        f"{A}=true": (Outcome.ADOPTED, 3),
        f"{S}=1": (Outcome.WORSE, 3),
        f"{S}=3": (Outcome.OUTPAID, 3),
    }
    # round 2: undoing the adopted step is not measured again
    undo = [r for r in campaign.candidates() if r.round == 2 and r.outcome is Outcome.SKIPPED]
    assert [(r.candidate.label, r.reason) for r in undo] == [
        (f"{A}=false", "undoes the step adopted in round 1")
    ]
    # round 3 adopts nothing: A=false is a new pair (S changed), so it is measured again
    assert _rows(campaign, 3)[f"{A}=false"] == (Outcome.WORSE, 3)
    assert _rows(campaign, 3)[f"{S}=2"] == (Outcome.SKIPPED, 0)
    confirm = [r for r in runs if r.round == 0]
    assert [r.role for r in confirm] == [Role.START, Role.FINAL] * RULE.max_repeats
    assert confirm[0].config == START and confirm[1].config == campaign.incumbent
    confirmed = campaign.confirmed()
    assert confirmed is not None and confirmed.agrees
    assert confirmed.total.estimate == pytest.approx(math.log(1.3 * 1.1), abs=0.01)
    assert confirmed.steps.estimate == pytest.approx(sum(s.gain.estimate for s in path))
    assert confirmed.interaction.estimate == pytest.approx(
        confirmed.total.estimate - confirmed.steps.estimate
    )
    assert campaign.runs_used == len(runs) <= 200


def test_nothing_pays_no_confirmation() -> None:
    campaign = Campaign(SPACE, START, RULE, budget=200)
    runs = _drive(campaign, _measure({(A, True): 0.7, (S, 1): 0.8, (S, 3): 0.9}, sigma=0.005))
    assert campaign.phase is Phase.DONE and campaign.path() == []
    assert campaign.incumbent == START and all(r.round == 1 for r in runs)
    assert campaign.confirmed() is None and campaign.cumulative() is None
    assert {o for o, _ in _rows(campaign, 1).values()} == {Outcome.WORSE}


def test_a_clearly_worse_candidate_stops_early_an_undecided_one_runs_to_the_cap() -> None:
    # S=3 has no effect but the noise (3 % a run) is too large to show it inert in 6 pairs
    campaign = Campaign(SPACE, START, RULE, budget=200)
    _drive(campaign, _measure({(A, True): 0.5, (S, 1): 0.8}, sigma=0.03, seed=1))
    rows = _rows(campaign, 1)
    assert rows[f"{A}=true"] == (Outcome.WORSE, 3)
    assert rows[f"{S}=3"] == (Outcome.UNDECIDED, RULE.max_repeats)


def test_a_candidate_that_cannot_beat_the_best_stops_early() -> None:
    campaign = Campaign(SPACE, START, RULE, budget=200)
    _drive(campaign, _measure({(A, True): 1.3}, sigma=0.01, seed=2))
    rows = _rows(campaign, 1)
    assert rows[f"{A}=true"] == (Outcome.ADOPTED, 3)
    assert rows[f"{S}=3"] == (Outcome.OUTPAID, 3)
    outpaid = next(r for r in campaign.candidates() if r.candidate.label == f"{S}=3")
    assert outpaid.reason.startswith(f"cannot beat {A}=true")


def test_an_inert_knob_is_called_inert_by_equivalence() -> None:
    space = Space(variables=(Variable(name=S, levels=(1, 2, 3)),))
    inert = Campaign(space, {S: 2}, RULE, budget=100)
    _drive(inert, _measure({}, sigma=0.002))
    assert _rows(inert, 1) == {f"{S}=1": (Outcome.INERT, 3), f"{S}=3": (Outcome.INERT, 3)}
    row = inert.candidates()[0]
    assert row.verdict is Verdict.INERT and row.reason.startswith("equivalent within +-2.0%")


def test_lower_is_better_objectives_flip_the_sign() -> None:
    campaign = Campaign(SPACE, START, RULE, budget=200, direction=Direction.LOWER)
    # TTFT: prefix caching cuts it by 30 %, S=3 raises it
    _drive(campaign, _measure({(A, True): 0.7, (S, 3): 1.2}, sigma=0.005))
    assert [s.to_level for s in campaign.path()] == [True]
    assert campaign.path()[0].gain.estimate == pytest.approx(-math.log(0.7), abs=0.01)
    assert _rows(campaign, 1)[f"{S}=3"][0] is Outcome.WORSE


def test_the_budget_reserves_the_confirmation_and_leaves_the_rest_unknown() -> None:
    rule = DecisionRule()
    budget = 2 * rule.max_repeats + 12
    campaign = Campaign(SPACE, START, rule, budget=budget)
    runs = _drive(campaign, _measure(CLIMB, sigma=0.005))
    assert campaign.runs_used == len(runs) <= budget
    # round 1 (3 cycles of 4 runs) adopts A; round 2 has no room left
    assert [s.variable for s in campaign.path()] == [A]
    assert {o for o, _ in _rows(campaign, 2).values()} == {Outcome.UNKNOWN, Outcome.SKIPPED}
    unknown = next(r for r in campaign.candidates() if r.outcome is Outcome.UNKNOWN)
    assert unknown.reason == "the budget ran out after 0 pairs"
    assert [r.role for r in runs[-12:]] == [Role.START, Role.FINAL] * 6
    confirmed = campaign.confirmed()
    assert confirmed is not None and confirmed.total.estimate > 0.2


def test_a_budget_without_room_is_refused() -> None:
    with pytest.raises(ValueError, match="leaves no room"):
        Campaign(SPACE, START, RULE, budget=13)
    with pytest.raises(ValueError, match="not one of its levels"):
        Campaign(SPACE, {A: False, S: 7}, RULE, budget=100)


def _prefix_first(incumbent: Config, candidates: Sequence[Candidate]) -> list[Triage]:
    """Puts S=3 first and skips prefix caching (as the prefix analyser would)."""
    ordered = sorted(candidates, key=lambda c: c.to_level != 3)
    return [
        Triage(c, skip="the prefix analyser predicts no hits" if c.variable == A else None)
        for c in ordered
    ]


def test_the_order_hook_orders_and_skips_with_a_reason() -> None:
    campaign = Campaign(SPACE, START, RULE, budget=200, order=_prefix_first)
    assert [r.label for r in campaign.next_runs()] == [
        "r1.c1.incumbent",
        f"r1.c1.{S}=3",
        f"r1.c1.{S}=1",
    ]
    _drive(campaign, _measure(CLIMB, sigma=0.005))
    skipped = [r for r in campaign.candidates() if r.candidate.variable == A]
    assert {(r.outcome, r.reason) for r in skipped} == {
        (Outcome.SKIPPED, "the prefix analyser predicts no hits")
    }
    assert [s.variable for s in campaign.path()] == [S]


def test_an_order_hook_must_keep_every_candidate() -> None:
    def drop(incumbent: Config, candidates: Sequence[Candidate]) -> list[Triage]:
        return [Triage(c) for c in candidates[1:]]

    with pytest.raises(ValueError, match="every candidate once"):
        Campaign(SPACE, START, RULE, budget=100, order=drop)


def test_a_failed_run_ends_its_candidate_failed() -> None:
    measure = _measure(CLIMB, sigma=0.005)

    def failing(run: PlannedRun) -> float | None:
        return None if run.config[S] == 1 else measure(run)

    campaign = Campaign(SPACE, START, RULE, budget=200)
    _drive(campaign, failing)
    failed = [r for r in campaign.candidates() if r.outcome is Outcome.FAILED]
    # it fails again from the next incumbent (a different pair)
    assert [(r.round, r.candidate.label, r.reason) for r in failed] == [
        (1, f"{S}=1", f"run r1.c1.{S}=1 failed"),
        (2, f"{S}=1", f"run r2.c1.{S}=1 failed"),
    ]
    assert campaign.incumbent == {A: True, S: 3}


def test_a_campaign_rebuilt_from_its_recorded_runs_goes_on_identically() -> None:
    """Resumable: at any point, a campaign rebuilt from the runs recorded so far plans
    the same next runs, and, driven on, ends with the same path."""
    rule = DecisionRule()
    measure = surface.Surface(seed=3).measure
    original = Campaign(surface.SPACE, surface.START, rule, budget=300)
    recorded: list[Recorded] = []
    #: pending[k]: the labels next_runs() gave after k recorded runs
    pending: list[list[str]] = [[r.label for r in original.next_runs()]]
    while batch := original.next_runs():
        run = batch[0]
        recorded.append(Recorded(run.label, measure(run.config)))
        original.record(run.label, recorded[-1].value)
        pending.append([r.label for r in original.next_runs()])
    assert len(recorded) > 100
    for cut in range(0, len(recorded), 9):
        rebuilt = Campaign(surface.SPACE, surface.START, rule, budget=300, recorded=recorded[:cut])
        assert [r.label for r in rebuilt.next_runs()] == pending[cut]
        assert rebuilt.runs_used == cut
    rebuilt = Campaign(surface.SPACE, surface.START, rule, budget=300, recorded=recorded)
    assert rebuilt.phase is Phase.DONE
    assert rebuilt.path() == original.path()
    assert rebuilt.candidates() == original.candidates()
    assert rebuilt.confirmed() == original.confirmed()


def test_the_round_in_progress_shows_its_candidates_measuring() -> None:
    campaign = Campaign(SPACE, START, RULE, budget=100)
    for run in campaign.next_runs():
        campaign.record(run.label, 100.0)
    rows = campaign.candidates()
    assert [(r.round, r.outcome, r.pairs) for r in rows] == [(1, Outcome.MEASURING, 1)] * 3


def test_client_side_changes_share_a_server() -> None:
    space = Space(
        variables=(
            Variable(name=S, levels=(1, 2)),
            Variable(name=RATE, levels=(1.0, 2.0), client_side=True),
        )
    )
    campaign = Campaign(space, {S: 1, RATE: 1.0}, RULE, budget=100)
    cycle = campaign.next_runs()
    assert [r.label for r in cycle] == ["r1.c1.incumbent", f"r1.c1.{S}=2", f"r1.c1.{RATE}=2.0"]
    assert cycle[0].server_key == cycle[2].server_key != cycle[1].server_key
    assert server_starts(cycle) == 3  # incumbent, S=2, back to the incumbent's server
    assert server_starts([cycle[0], cycle[2]]) == 1


def test_a_failed_incumbent_run_loses_its_cycle_only() -> None:
    measure = _measure(CLIMB, sigma=0.005)

    def failing(run: PlannedRun) -> float | None:
        return None if run.label == "r1.c1.incumbent" else measure(run)

    campaign = Campaign(SPACE, START, RULE, budget=200)
    runs = _drive(campaign, failing)
    # no pair from cycle 1: round 1 takes a fourth cycle for its min_repeats pairs
    assert _rows(campaign, 1)[f"{A}=true"] == (Outcome.ADOPTED, 3)
    assert f"r1.c4.{A}=true" in {r.label for r in runs}
    assert not any(r.outcome is Outcome.FAILED for r in campaign.candidates())
    assert campaign.path()[0].round == 1
    assert campaign.incumbent == {A: True, S: 3}


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    budget=st.integers(14, 260),
    max_repeats=st.integers(3, 8),
    sigma=st.sampled_from([0.0, 0.01, 0.05]),
)
def test_any_campaign_keeps_its_budget_and_walks_one_variable_at_a_time(
    seed: int, budget: int, max_repeats: int, sigma: float
) -> None:
    rule = DecisionRule(max_repeats=max_repeats)
    if budget < 2 * max_repeats + 2:
        with pytest.raises(ValueError, match="leaves no room"):
            Campaign(surface.SPACE, surface.START, rule, budget)
        return
    surf = surface.Surface(seed, sigma=sigma)
    campaign = Campaign(surface.SPACE, surface.START, rule, budget)
    runs = _drive(campaign, lambda run: surf.measure(run.config))
    assert campaign.phase is Phase.DONE
    assert campaign.runs_used == len(runs) <= budget
    assert len({r.label for r in runs}) == len(runs)
    config = dict(surface.START)
    for step in campaign.path():
        assert config[step.variable] == step.from_level != step.to_level
        config[step.variable] = step.to_level
        assert step.gain.low > rule.pay_threshold
    assert config == campaign.incumbent
    adopted = [r for r in campaign.candidates() if r.outcome is Outcome.ADOPTED]
    assert [(r.round, r.candidate.variable) for r in adopted] == [
        (s.round, s.variable) for s in campaign.path()
    ]
    confirm = [r for r in runs if r.round == 0]
    if campaign.path():
        assert len(confirm) == 2 * max_repeats
    else:
        assert confirm == [] and campaign.confirmed() is None
    for row in campaign.candidates():
        assert row.outcome is not Outcome.MEASURING
        assert row.pairs <= max_repeats


def test_a_paying_candidate_that_breaks_a_constraint_is_infeasible_never_adopted() -> None:
    """Prefix caching pays most, but its runs' p99 TTFT breaks the SLO: it ends
    ``infeasible`` with the breach and the round adopts the next best paying candidate;
    a constraint no run of a candidate has a trustworthy value for cannot be shown to
    hold, so that candidate is infeasible too."""
    slo = Constraint(metric="p99_ttft_ms", max=500.0)
    measure = _measure(CLIMB, sigma=0.005)

    def drive(ttft: Callable[[PlannedRun], float | None]) -> Campaign:
        campaign = Campaign(SPACE, START, RULE, budget=200, constraints=[slo])
        while batch := campaign.next_runs():
            for run in batch:
                campaign.record(run.label, measure(run), checks={slo.metric: ttft(run)})
        return campaign

    slow_apc = drive(lambda run: 800.0 if run.config[A] is True else 300.0)
    row = {r.candidate.label: r for r in slow_apc.candidates() if r.round == 1}[f"{A}=true"]
    assert row.outcome is Outcome.INFEASIBLE
    assert row.reason == "breaks p99_ttft_ms <= 500: median 800 over 3 runs"
    assert [(s.variable, s.to_level) for s in slow_apc.path()] == [(S, 3)]
    assert slow_apc.incumbent[A] is False
    # the same campaign without the breach adopts prefix caching first
    fine = drive(lambda run: 300.0)
    assert [(s.variable, s.to_level) for s in fine.path()] == [(A, True), (S, 3)]
    # no value that gives a verdict (flagged, or missing) for prefix caching's runs
    unknown = drive(lambda run: None if run.config[A] is True else 300.0)
    row = {r.candidate.label: r for r in unknown.candidates() if r.round == 1}[f"{A}=true"]
    assert row.outcome is Outcome.INFEASIBLE
    assert row.reason.startswith("cannot show p99_ttft_ms <= 500: 3 of 3 runs without")


def test_a_constraint_holds_on_the_median_of_at_least_half_the_runs() -> None:
    both = Constraint(metric="output_throughput", min=10.0, max=20.0)
    assert both.describe() == "output_throughput >= 10 and output_throughput <= 20"
    assert both.breach([9.0, 15.0, 16.0]) is None  # one run below: the median holds
    assert both.breach([21.0, 22.0, 15.0]) == (
        "breaks output_throughput >= 10 and output_throughput <= 20: median 21 over 3 runs"
    )
    assert both.breach([15.0, None, None]) is not None  # one value of three: not shown
    assert both.breach([15.0, None]) is None


def test_a_device_hour_budget_stops_the_rounds_at_the_runs_it_affords() -> None:
    """Each run holds 2 devices for 100 s (200 device-seconds): a budget of 5,000
    device-seconds affords 25 runs at that mean, the confirmation's reserve among them;
    the rounds stop there, the candidates left end unknown saying which budget ran out,
    and the confirmation still runs."""
    measure = _measure(CLIMB, sigma=0.005)
    campaign = Campaign(SPACE, START, RULE, budget=200, max_device_s=5_000.0)
    while batch := campaign.next_runs():
        for run in batch:
            campaign.record(run.label, measure(run), device_s=200.0)
    assert campaign.phase is Phase.DONE and campaign.confirmed() is not None
    assert campaign.device.used == 200.0 * campaign.runs_used
    assert campaign.runs_used <= 25
    unknown = [r for r in campaign.candidates() if r.outcome is Outcome.UNKNOWN]
    assert unknown and all(r.reason.startswith("the device-hour budget ran out") for r in unknown)
    # without the device budget the same campaign runs on
    free = Campaign(SPACE, START, RULE, budget=200)
    _drive(free, measure)
    assert free.runs_used > 25


def test_a_wall_time_budget_stops_the_rounds_at_the_runs_it_affords() -> None:
    """Runs end 60 s apart, one after another: a wall-time budget of 1,800 s affords 30
    runs at that pace, the confirmation's reserve among them; the rounds stop there with
    the candidates left unknown saying which budget ran out, the confirmation still runs
    and ends within the budget; replayed from its records it decides the same."""
    measure = _measure(CLIMB, sigma=0.005)
    campaign = Campaign(SPACE, START, RULE, budget=200, max_wall_s=1_800.0)
    records: list[Recorded] = []
    while batch := campaign.next_runs():
        for run in batch:
            records.append(Recorded(run.label, measure(run), ended_s=60.0 * (len(records) + 1)))
            campaign.record(run.label, records[-1].value, ended_s=records[-1].ended_s)
    assert campaign.phase is Phase.DONE and campaign.confirmed() is not None
    assert campaign.wall.used == 60.0 * campaign.runs_used <= 1_800.0
    unknown = [r for r in campaign.candidates() if r.outcome is Outcome.UNKNOWN]
    assert unknown and all(r.reason.startswith("the wall-time budget ran out") for r in unknown)
    again = Campaign(SPACE, START, RULE, budget=200, max_wall_s=1_800.0, recorded=records)
    assert again.phase is Phase.DONE
    assert [(c.candidate.label, c.outcome) for c in again.candidates()] == [
        (c.candidate.label, c.outcome) for c in campaign.candidates()
    ]


def test_side_by_side_plans_pairs_at_once_each_configuration_in_a_row() -> None:
    """With a server slot for each of the cycle's 4 configurations, the first cycle plans
    ``min_repeats`` pairs at once, each configuration's runs in a row (one server each);
    the next ones 2 pairs; with one slot too few, one pair a cycle as before."""
    campaign = Campaign(SPACE, START, RULE, budget=200, slots=4)
    runs = campaign.next_runs()
    n = RULE.min_repeats
    assert [r.label for r in runs[: n + 1]] == [
        *(f"r1.c{c}.incumbent" for c in range(1, n + 1)),
        "r1.c1.engine_args.enable_prefix_caching=true",
    ]
    assert len(runs) == 4 * n and server_starts(runs) == 4
    assert [r.cycle for r in runs] == list(range(1, n + 1)) * 4
    measure = _measure({(S, 3): 1.02}, sigma=0.05)  # nothing decided after 3 pairs
    for run in runs:
        campaign.record(run.label, measure(run))
    second = campaign.next_runs()
    assert {(r.round, r.cycle) for r in second} == {(1, n + 1), (1, n + 2)}
    assert server_starts(second) == len({r.server_key for r in second})
    narrow = Campaign(SPACE, START, RULE, budget=200, slots=3)
    assert [r.cycle for r in narrow.next_runs()] == [1, 1, 1, 1]


def test_side_by_side_decides_as_interleaving_does_on_the_same_values() -> None:
    """Noise-free values: the same path, outcomes and confirmation whatever the slots; the
    confirmation's pairs all at once (2 servers); a replay from the records (in any order
    within a cycle) gives the same state; the budget holds."""
    measure = _measure(CLIMB, sigma=0.0)
    one = Campaign(SPACE, START, RULE, budget=200)
    _drive(one, measure)
    wide = Campaign(SPACE, START, RULE, budget=200, slots=8)
    records: list[Recorded] = []
    while batch := wide.next_runs():
        if batch[0].round == 0:
            assert len(batch) == 2 * RULE.max_repeats and server_starts(batch) == 2
        for run in reversed(batch):
            records.append(Recorded(run.label, measure(run)))
            wide.record(run.label, records[-1].value)
    assert wide.phase is Phase.DONE and wide.runs_used <= 200
    assert [(s.variable, s.to_level) for s in wide.path()] == [
        (s.variable, s.to_level) for s in one.path()
    ]
    assert {(r.candidate.label, r.outcome) for r in wide.candidates()} == {
        (r.candidate.label, r.outcome) for r in one.candidates()
    }
    confirmed = wide.confirmed()
    assert confirmed is not None and confirmed.agrees
    again = Campaign(SPACE, START, RULE, budget=200, slots=8, recorded=records)
    assert again.phase is Phase.DONE and again.path() == wide.path()


def test_side_by_side_keeps_to_the_budget() -> None:
    """A budget that affords fewer pairs than ``min_repeats`` for every configuration:
    the cycle plans what it affords, and the campaign never passes the budget."""
    campaign = Campaign(SPACE, START, RULE, budget=2 * RULE.max_repeats + 10, slots=4)
    first = campaign.next_runs()
    assert len(first) <= 10 and len(first) % 4 == 0
    _drive(campaign, _measure(CLIMB, sigma=0.02))
    assert campaign.runs_used <= campaign.budget
