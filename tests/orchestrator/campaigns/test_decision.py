"""The decision rule: paired log-ratio intervals and the verdicts they give."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from orchestrator.campaigns.decision import (
    DecisionRule,
    Direction,
    Gain,
    Verdict,
    gain_from_pairs,
    judge,
    log_ratio,
    needs_more,
    sum_gains,
    t_quantile,
)

RULE = DecisionRule()


def _gain(low: float, high: float, n: int = 3) -> Gain:
    mid = (low + high) / 2
    return Gain(estimate=mid, low=low, high=high, se=0.01, df=n - 1, n=n, confidence=0.95)


def test_rule_defaults_and_thresholds() -> None:
    assert (RULE.confidence, RULE.min_gain, RULE.equivalence_margin) == (0.95, 0.05, 0.02)
    assert (RULE.min_repeats, RULE.max_repeats) == (3, 6)
    assert RULE.pay_threshold == pytest.approx(math.log(1.05))
    assert RULE.inert_threshold == pytest.approx(math.log(1.02))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_repeats": 5, "max_repeats": 4}, "below min_repeats"),
        ({"min_gain": 0.02, "equivalence_margin": 0.03}, "cannot also be inert"),
        ({"confidence": 1.0}, "less than 1"),
        ({"min_repeats": 1}, "greater than or equal to 2"),
        ({"threshold": 0.1}, "Extra inputs"),
    ],
)
def test_rule_refuses_inconsistent_fields(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DecisionRule.model_validate(fields)


def test_log_ratio_is_signed_by_direction() -> None:
    assert log_ratio(100.0, 110.0, Direction.HIGHER) == pytest.approx(math.log(1.1))
    # TTFT: 110 ms against 100 ms is worse
    assert log_ratio(100.0, 110.0, Direction.LOWER) == pytest.approx(-math.log(1.1))
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="positive and finite"):
            log_ratio(100.0, bad, Direction.HIGHER)


def test_gain_from_pairs_is_the_paired_t_interval_of_log_ratios() -> None:
    pairs = [(100.0, 110.0), (102.0, 110.0), (98.0, 111.0), (101.0, 109.0)]
    diffs = [math.log(c / i) for i, c in pairs]
    mean = sum(diffs) / 4
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3)
    half = 2.3533634 * sd / 2  # t(0.95, df=3), one-sided
    gain = gain_from_pairs(pairs, 0.95)
    assert gain.estimate == pytest.approx(mean)
    assert (gain.low, gain.high) == (pytest.approx(mean - half), pytest.approx(mean + half))
    assert (gain.n, gain.df, gain.se) == (4, 3, pytest.approx(sd / 2))
    lower = gain_from_pairs(pairs, 0.95, Direction.LOWER)
    assert (lower.estimate, lower.low) == (pytest.approx(-mean), pytest.approx(-mean - half))


def test_gain_from_pairs_needs_two_pairs() -> None:
    with pytest.raises(ValueError, match="at least 2 pairs"):
        gain_from_pairs([(1.0, 2.0)], 0.95)


def test_identical_ratios_give_a_point_interval() -> None:
    gain = gain_from_pairs([(100.0, 110.0)] * 3, 0.95)
    assert gain.low == gain.high == pytest.approx(math.log(1.1))
    assert gain.relative == pytest.approx(0.1)
    assert gain.describe() == "+10.0% [+10.0%, +10.0%]"


def test_t_quantile_matches_tables() -> None:
    assert t_quantile(0.95, 2) == pytest.approx(2.919986, abs=1e-6)
    assert t_quantile(0.975, 5) == pytest.approx(2.570582, abs=1e-6)


@pytest.mark.parametrize(
    ("low", "high", "verdict"),
    [
        (0.06, 0.20, Verdict.PAYS),  # lower bound above log(1.05) = 0.0488
        (-0.20, -0.01, Verdict.WORSE),
        (-0.015, 0.015, Verdict.INERT),  # inside +-log(1.02) = 0.0198
        (-0.015, -0.005, Verdict.INERT),  # significantly off 0, but inside the margin
        (0.005, 0.015, Verdict.INERT),
        (0.01, 0.04, Verdict.MARGINAL),  # a real gain, below min_gain
        (0.01, 0.30, Verdict.MARGINAL),  # real, not yet shown to reach min_gain
        (-0.03, 0.10, Verdict.UNDECIDED),
        (-0.025, 0.01, Verdict.UNDECIDED),  # not worse, not shown inert
    ],
)
def test_judge(low: float, high: float, verdict: Verdict) -> None:
    assert judge(_gain(low, high), RULE) is verdict


def test_needs_more_while_a_threshold_is_straddled() -> None:
    undecided = _gain(-0.03, 0.10)
    assert needs_more(undecided, RULE, 2)  # below min_repeats, whatever the interval
    assert needs_more(undecided, RULE, 3)
    assert not needs_more(undecided, RULE, 6)  # max_repeats
    assert not needs_more(_gain(0.06, 0.20), RULE, 3)  # pays: final
    assert not needs_more(_gain(-0.20, -0.01), RULE, 3)  # worse: final
    assert not needs_more(_gain(-0.015, 0.015), RULE, 3)  # inert: final
    assert needs_more(_gain(0.01, 0.30), RULE, 3)  # may still pay
    assert not needs_more(_gain(0.01, 0.04), RULE, 3)  # marginal, cannot pay
    assert needs_more(_gain(-0.025, 0.01), RULE, 3)  # may still be shown worse or inert


def test_sum_gains_adds_log_gains_with_welch_degrees_of_freedom() -> None:
    a = Gain(estimate=0.10, low=0.05, high=0.15, se=0.02, df=2, n=3, confidence=0.95)
    b = Gain(estimate=0.20, low=0.10, high=0.30, se=0.03, df=5, n=6, confidence=0.95)
    total = sum_gains([a, b])
    var = 0.02**2 + 0.03**2
    df = var**2 / (0.02**4 / 2 + 0.03**4 / 5)
    assert total.estimate == pytest.approx(0.30)
    assert (total.se, total.df, total.n) == (pytest.approx(math.sqrt(var)), pytest.approx(df), 3)
    assert total.high - total.estimate == pytest.approx(t_quantile(0.95, df) * math.sqrt(var))
    diff = sum_gains([b, a], sign=(1.0, -1.0))
    assert diff.estimate == pytest.approx(0.10)
    assert diff.se == pytest.approx(total.se)


def test_sum_gains_refuses_empty_and_mixed() -> None:
    a = _gain(0.0, 0.1)
    with pytest.raises(ValueError, match="no gains"):
        sum_gains([])
    with pytest.raises(ValueError, match="confidence"):
        sum_gains([a, a.model_copy(update={"confidence": 0.9})])
    with pytest.raises(ValueError, match="one sign per gain"):
        sum_gains([a, a], sign=(1.0,))
