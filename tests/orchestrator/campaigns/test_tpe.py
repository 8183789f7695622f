"""The Optuna TPE baseline of the response-surface comparison (tests/orchestrator/campaigns/
surface.py, ``tpe_study``): auto-tune-vllm's way of running Optuna, on the same surface and
budget as the campaign. Pure and fast: a few short studies."""

from __future__ import annotations

import statistics

from tests.orchestrator.campaigns import surface

BUDGET = 40


def test_a_study_spends_its_budget_one_server_start_a_trial() -> None:
    study = surface.tpe_study(0, budget=BUDGET)
    assert len(study.trials) == BUDGET
    assert study.server_starts == BUDGET


def test_every_trial_is_a_configuration_of_the_space() -> None:
    levels = {v.name: v.levels for v in surface.SPACE.variables}
    for seed in (0, 1):
        study = surface.tpe_study(seed, budget=BUDGET)
        for config, _ in study.trials:
            assert set(config) == set(levels)
            assert all(config[name] in levels[name] for name in levels)
            # strictly the level's type: True is not taken for 1, nor 16 for True
            assert all(type(config[name]) in {type(x) for x in levels[name]} for name in levels)


def test_a_seed_gives_one_study_and_seeds_differ() -> None:
    first, again = surface.tpe_study(3, budget=BUDGET), surface.tpe_study(3, budget=BUDGET)
    assert first.trials == again.trials
    assert first.best == again.best
    assert surface.tpe_study(4, budget=BUDGET).trials != first.trials


def test_the_reported_configuration_is_the_best_measured_trial() -> None:
    study = surface.tpe_study(2, budget=BUDGET)
    best_config, _ = max(study.trials, key=lambda trial: trial[1])
    assert study.best == best_config


def test_tpe_maximizes_after_its_random_startup() -> None:
    """After the random startup trials, TPE samples better configurations than it did at
    random: the study maximizes the measured output tokens/s (a minimizing study, or one
    that ignored the measurements, fails this)."""
    for seed in (0, 1, 2):
        study = surface.tpe_study(seed, budget=BUDGET)
        values = [surface.objective(config) for config, _ in study.trials]
        startup = values[: surface.TPE_STARTUP_TRIALS]
        late = values[BUDGET // 2 :]
        assert statistics.fmean(late) > statistics.fmean(startup)
        assert sum(config[surface.APC] for config, _ in study.trials[BUDGET // 2 :]) > BUDGET // 4


def test_runs_to_optimum_counts_to_the_first_best_so_far_within_2_percent() -> None:
    best = {**surface.START, surface.APC: True, surface.SEQS: 128, surface.BATCHED: 16384}
    start = dict(surface.START)
    # the optimum measured low at trial 2 is not yet the best so far; at trial 3 it is
    trials = [(start, 1100.0), (best, 1000.0), (best, 1200.0), (start, 1300.0)]
    assert surface.Study(trials=trials, best=start).runs_to_optimum == 3
    assert surface.Study(trials=[(start, 1100.0)], best=start).runs_to_optimum is None
