"""The proof of issue 25 on the response-surface test double (tests/orchestrator/campaigns/
surface.py): 50 seeded campaigns from vLLM's serving defaults with prefix caching off.

Each campaign reaches the known optimum (within 2 % of its objective) within a third of the
runs of the full grid that ``vllm bench sweep serve`` would run (every configuration, 3 runs
each); the inert knob (block size) is adopted in at most 5 % of the campaigns, the harmful
one (eager mode) never. The figures are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import math
import statistics

import pytest

from orchestrator.campaigns.decision import DecisionRule
from orchestrator.campaigns.outcomes import Outcome, server_starts
from orchestrator.campaigns.space import grid_size
from tests.orchestrator.campaigns import surface

CAMPAIGNS = 50


@pytest.fixture(scope="module")
def proof() -> list[surface.Outcomes]:
    return [
        surface.run_campaign(seed, surface.PROOF_RULE, surface.THIRD_OF_GRID)
        for seed in range(CAMPAIGNS)
    ]


def test_the_surface_is_what_its_docstring_says() -> None:
    best = {**surface.START, surface.APC: True, surface.SEQS: 128, surface.BATCHED: 16384}
    assert surface.objective(best) == pytest.approx(surface.OPTIMUM)
    assert pytest.approx(1000 * 1.3 * 1.1**3) == surface.OPTIMUM
    assert surface.objective({**best, surface.BLOCK: 32}) == surface.OPTIMUM
    assert surface.objective({**best, surface.EAGER: True}) == pytest.approx(0.75 * surface.OPTIMUM)
    assert surface.objective({**best, surface.SEQS: 512}) == pytest.approx(0.81 * surface.OPTIMUM)
    # the interaction: batched tokens matter only with prefix caching on
    off = {**surface.START, surface.BATCHED: 16384}
    assert surface.objective(off) == surface.objective(surface.START)
    assert surface.GRID_RUNS == grid_size(surface.SPACE) * 3 == 480
    measure = surface.Surface(seed=1).measure
    noisy = [measure(best) for _ in range(3)]
    assert len(set(noisy)) == 3
    assert all(abs(math.log(v / surface.OPTIMUM)) < 0.1 for v in noisy)


def test_every_campaign_reaches_the_optimum(proof: list[surface.Outcomes]) -> None:
    missed = {i: round(r.final_ratio, 3) for i, r in enumerate(proof) if r.final_ratio < 0.98}
    assert missed == {}


@pytest.fixture(scope="module")
def side_by_side() -> list[surface.Outcomes]:
    """The same campaigns on a cluster that holds each configuration of a cycle on its own
    devices: pairs planned several at once, each configuration's runs on one server."""
    return [
        surface.run_campaign(seed, surface.PROOF_RULE, surface.THIRD_OF_GRID, surface.SIDE_BY_SIDE)
        for seed in range(CAMPAIGNS)
    ]


def test_within_a_third_of_the_grid(proof: list[surface.Outcomes]) -> None:
    assert max(len(r.runs) for r in proof) <= surface.GRID_RUNS / 3


def test_side_by_side_starts_a_third_of_the_grids_servers_and_decides_as_well(
    side_by_side: list[surface.Outcomes],
) -> None:
    """Server starts counted from the runs as planned (consecutive runs of one
    configuration share a server, as the dispatcher batches them): on average at most a
    third of the grid's one start per configuration; the optimum, the inert and harmful
    knobs as in the interleaved proof."""
    starts = [server_starts(r.runs) for r in side_by_side]
    assert statistics.fmean(starts) <= grid_size(surface.SPACE) / 3
    assert max(len(r.runs) for r in side_by_side) <= surface.GRID_RUNS / 3
    assert [i for i, r in enumerate(side_by_side) if r.final_ratio < 0.98] == []
    assert sum(r.adopted(surface.BLOCK) for r in side_by_side) <= 0.05 * CAMPAIGNS
    assert not any(r.adopted(surface.EAGER) for r in side_by_side)


def test_the_inert_knob_is_rarely_adopted_the_harmful_never(
    proof: list[surface.Outcomes],
) -> None:
    assert sum(r.adopted(surface.BLOCK) for r in proof) <= 0.05 * CAMPAIGNS
    assert not any(r.adopted(surface.EAGER) for r in proof)
    eager = [
        row
        for r in proof
        for row in r.campaign.candidates()
        if row.candidate.variable == surface.EAGER and row.outcome is not Outcome.SKIPPED
    ]
    assert eager and {row.outcome for row in eager} <= {Outcome.WORSE, Outcome.UNKNOWN}


def test_each_campaign_confirms_its_path(proof: list[surface.Outcomes]) -> None:
    # the true total: the optimum over the start (x1.30 x1.111 x1.10^3 = x1.92)
    truth = math.log(surface.OPTIMUM / surface.objective(surface.START))
    for r in proof:
        confirmed = r.campaign.confirmed()
        assert confirmed is not None
        assert confirmed.total.estimate == pytest.approx(truth, abs=0.03)
    agree = sum(bool((c := r.campaign.confirmed()) and c.agrees) for r in proof)
    assert agree >= 0.8 * CAMPAIGNS


def test_the_default_rule_reaches_the_optimum_in_most_campaigns() -> None:
    """With 6 pairs at most, a +10 % step is sometimes left 'marginal' (its lower bound not
    shown above +5 %) and the campaign stops one step short: 46 of 50 reach the optimum."""
    results = [
        surface.run_campaign(seed, DecisionRule(), surface.THIRD_OF_GRID)
        for seed in range(CAMPAIGNS)
    ]
    reached = sum(r.final_ratio >= 0.98 for r in results)
    assert reached >= 0.9 * CAMPAIGNS
    assert not any(r.adopted(surface.EAGER) or r.adopted(surface.BLOCK) for r in results)
    assert max(len(r.runs) for r in results) <= surface.GRID_RUNS / 3
