"""The regression floor (orchestrator.analysis.regression): a worse verdict is a regression
only when its point ratio lies at least ``min_change`` beyond 1 in the bad direction
(asv's ``--factor``); a capacity ``lower`` verdict likewise, on its ratio or, one-sided,
its bound."""

from __future__ import annotations

import pytest

from orchestrator.analysis.capacity_compare import capacity_regression, compare_capacity
from orchestrator.analysis.regression import (
    MIN_CHANGE,
    bad_change,
    capacity_is_regression,
    drop,
    floor_drop,
    is_regression,
    percent,
    percents_apart,
)
from tests.orchestrator.analysis.test_capacity_compare import doc, rep


def test_the_default_floor_is_five_percent() -> None:
    assert MIN_CHANGE == 0.05


@pytest.mark.parametrize(
    ("ratio", "regression"),
    [(1.002, False), (1.049, False), (1.05, True), (105 / 100, True), (1.3, True)],
)
def test_lower_is_better_needs_the_ratio_at_or_past_one_plus_the_floor(
    ratio: float, regression: bool
) -> None:
    assert is_regression("lower_is_better", "worse", ratio) is regression
    assert is_regression("lower_is_better", "worse", ratio, 0.0)  # 0: any worse verdict


@pytest.mark.parametrize(
    ("ratio", "regression"),
    [(0.998, False), (0.96, False), (1 / 1.05, True), (100 / 105, True), (0.5, True)],
)
def test_higher_is_better_needs_the_ratio_at_or_below_its_inverse(
    ratio: float, regression: bool
) -> None:
    assert is_regression("higher_is_better", "worse", ratio) is regression
    assert is_regression("higher_is_better", "worse", ratio, 0.0)


def test_only_a_worse_verdict_is_a_regression() -> None:
    for verdict in ("better", "no clear difference", "untrusted", "insufficient data"):
        assert not is_regression("lower_is_better", verdict, 3.0)
        assert not is_regression("higher_is_better", verdict, 0.2)
    # neutral metrics have higher / lower verdicts, never worse
    assert not is_regression("neutral", "higher", 3.0)
    # a worse verdict with no ratio (the reference is 0): no relative size can be small
    assert is_regression("lower_is_better", "worse", None)


def test_a_custom_floor() -> None:
    assert not is_regression("lower_is_better", "worse", 1.08, 0.10)
    assert is_regression("lower_is_better", "worse", 1.10, 0.10)
    assert is_regression("lower_is_better", "worse", 1.002, 0.001)


def test_the_size_in_the_bad_direction_and_its_words() -> None:
    assert bad_change("lower_is_better", 1.002) == pytest.approx(0.002)
    assert bad_change("higher_is_better", 0.8) == pytest.approx(0.25)
    assert bad_change("neutral", 2.0) is None and bad_change("lower_is_better", None) is None
    assert percent(0.002) == "0.2 %" and percent(MIN_CHANGE) == "5 %"


def test_the_size_printed_is_the_rise_or_the_drop_a_person_reads() -> None:
    """A throughput ratio 0.96 is a 4 % drop (not 1 / 0.96 - 1 = 4.2 %); a latency ratio
    1.3 a 30 % rise; the 5 % floor is a drop of 4.76 % for a higher-is-better metric."""
    assert drop("higher_is_better", 0.96) == pytest.approx(0.04)
    assert drop("lower_is_better", 1.3) == pytest.approx(0.3)
    assert drop("lower_is_better", 0.995) == pytest.approx(-0.005)  # the good side
    assert drop("neutral", 2.0) is None and drop("higher_is_better", None) is None
    assert floor_drop("higher_is_better", MIN_CHANGE) == pytest.approx(1 - 1 / 1.05)
    assert floor_drop("lower_is_better", MIN_CHANGE) == MIN_CHANGE
    # a ratio of 1 / 1.05 drops exactly the floor's drop: a regression, as the rule says
    assert is_regression("higher_is_better", "worse", 1 - floor_drop("higher_is_better", 0.05))


def test_a_size_under_the_floor_never_reads_as_the_floor() -> None:
    assert percents_apart(0.0496, 0.05) == ("4.96 %", "5 %")
    assert percents_apart(0.002, 0.05) == ("0.2 %", "5 %")
    assert percents_apart(0.0476, 1 - 1 / 1.05) == ("4.760 %", "4.762 %")
    size, floor = percents_apart(0.04999, 0.05)
    assert (size, floor) == ("4.999 %", "5 %")
    assert percents_apart(0.05 - 1e-12, 0.05) == ("just under 5 %", "5 %")


def test_capacity_lower_needs_its_ratio_or_one_sided_bound_past_the_floor() -> None:
    assert not capacity_is_regression("lower", 0.97, 0.99)
    assert capacity_is_regression("lower", 1 / 1.05, 0.99)
    assert capacity_is_regression("lower", 0.5, 0.6)
    # one-sided (no ratio): the interval's upper end decides
    assert not capacity_is_regression("lower", None, 0.97)
    assert capacity_is_regression("lower", None, 1 / 1.05)
    assert capacity_is_regression("lower", None, 0.97, 0.0)
    for verdict in ("higher", "no_change", "unknown", "untrusted"):
        assert not capacity_is_regression(verdict, 0.5, 0.6)


def test_a_small_capacity_drop_is_lower_but_no_regression() -> None:
    ref = [rep(doc(10.0, 10.0, 10.05))]
    small = compare_capacity([rep(doc(9.8, 9.8, 9.85))], ref)  # 2 %: the whole bracket below 1
    assert small.verdict == "lower" and small.ratio == pytest.approx(0.98)
    assert not capacity_regression(small)
    assert capacity_regression(small, 0.0)
    large = compare_capacity([rep(doc(6.0, 6.0, 6.3))], ref)
    assert large.verdict == "lower" and capacity_regression(large)


def test_a_one_sided_capacity_drop_is_judged_on_its_bound() -> None:
    # at least 10 before; found 9.7 [9.7, 9.8] now: at most 0.98x, a 2 % drop at most known
    ref = [rep(doc(None, 10.0, None, status="at_least_max"))]
    small = compare_capacity([rep(doc(9.7, 9.7, 9.8))], ref)
    assert small.verdict == "lower" and small.ratio is None
    assert small.ci_high == pytest.approx(0.98)
    assert not capacity_regression(small)
    large = compare_capacity([rep(doc(8.0, 8.0, 8.4))], ref)
    assert large.verdict == "lower" and large.ci_high == pytest.approx(0.84)
    assert capacity_regression(large)
