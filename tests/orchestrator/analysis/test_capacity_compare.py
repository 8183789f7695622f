"""Capacity under SLOs compared (orchestrator.analysis.capacity_compare): ratio, bracket interval,
verdict, per-device ratio, and unknown whenever a side has no found capacity."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator.analysis.capacity_compare import (
    CapacityRepeat,
    capacity_regression,
    compare_capacity,
    side_capacity,
)


def doc(
    capacity: float | None,
    lo: float | None = None,
    hi: float | None = None,
    *,
    status: str = "found",
    variable: str = "request_rate",
    binding: str | None = "ttft_ms p99",
) -> dict[str, Any]:
    """A ``runs.capacity`` document as ``CapacityResult.model_dump(mode="json")`` gives it."""
    return {
        "variable": variable,
        "status": status,
        "capacity": capacity,
        "interval": [lo, hi],
        "binding_slo": binding,
        "steps": [],
        "note": None,
    }


def rep(
    d: dict[str, Any] | None, *, devices: int = 1, status: str = "succeeded", i: int = 0
) -> CapacityRepeat:
    return CapacityRepeat(run_id=f"r{i}-{id(d)}", status=status, capacity=d, devices=devices)


def test_higher_when_the_whole_bracket_interval_is_above_one() -> None:
    ref = [rep(doc(4.0, 4.0, 4.2))]
    var = [rep(doc(8.0, 8.0, 8.4))]
    c = compare_capacity(var, ref)
    assert c.verdict == "higher" and c.reason is None
    assert c.ratio == pytest.approx(2.0)
    assert c.ci_low == pytest.approx(8.0 / 4.2) and c.ci_high == pytest.approx(8.4 / 4.0)
    assert c.ci_low is not None and c.ci_high is not None
    assert c.ci_low <= c.ratio <= c.ci_high
    assert c.capacity == 8.0 and c.reference_capacity == 4.0
    assert c.variable == "request_rate" and c.unit == "requests/s"
    assert c.interval == {"reference": [4.0, 4.2], "variant": [8.0, 8.4]}
    assert c.found == {"reference": 1, "variant": 1}
    assert c.per_device_ratio == pytest.approx(2.0) and c.per_device_verdict == "higher"
    assert any("one found repeat" in n for n in c.notes)
    assert not capacity_regression(c)


def test_lower_is_a_regression_and_overlap_is_no_change() -> None:
    ref = [rep(doc(10.0, 10.0, 10.5))]
    low = compare_capacity([rep(doc(6.0, 6.0, 6.3))], ref)
    assert low.verdict == "lower" and capacity_regression(low)
    assert low.ci_high == pytest.approx(6.3 / 10.0)
    same = compare_capacity([rep(doc(10.2, 10.2, 10.7))], ref)
    assert same.verdict == "no_change" and not capacity_regression(same)
    assert same.ci_low is not None and same.ci_high is not None
    assert same.ci_low < 1.0 < same.ci_high


def test_mean_capacity_and_the_envelope_of_the_repeats_brackets() -> None:
    ref = [rep(doc(4.0, 4.0, 5.0), i=0), rep(doc(6.0, 6.0, 7.0), i=1)]
    var = [rep(doc(9.0, 9.0, 10.0), i=0), rep(doc(11.0, 11.0, 12.0), i=1)]
    c = compare_capacity(var, ref)
    # means: reference 5, variant 10; envelopes: reference [4, 7], variant [9, 12]
    assert c.reference_capacity == pytest.approx(5.0) and c.capacity == pytest.approx(10.0)
    assert c.ratio == pytest.approx(2.0)
    assert c.interval == {"reference": [4.0, 7.0], "variant": [9.0, 12.0]}
    assert c.ci_low == pytest.approx(9.0 / 7.0) and c.ci_high == pytest.approx(12.0 / 4.0)
    assert c.verdict == "higher"
    assert c.found == {"reference": 2, "variant": 2}
    assert any("reference: repeats' capacities spread 4..6" in n for n in c.notes)


def test_a_repeat_that_shows_nothing_makes_the_verdict_unknown() -> None:
    # found 8 and uncertain with no bracket at all against 4: not "higher" from the found one
    var = [rep(doc(8.0, 8.0, 8.4), i=0), rep(doc(None, status="uncertain"), i=1)]
    c = compare_capacity(var, [rep(doc(4.0, 4.0, 4.2))])
    assert c.verdict == "unknown" and not capacity_regression(c)
    assert c.reason == "variant: 1 of 2 repeats show neither a capacity nor a bound: uncertain"
    assert c.ratio is None and c.ci_low is None and c.ci_high is None
    assert c.capacity is None and c.reference_capacity == 4.0
    assert c.per_device_verdict == "unknown" and c.per_device_ratio is None
    assert c.found == {"reference": 1, "variant": 1}
    assert any("1 of 2 repeats found a capacity (8)" in n for n in c.notes)
    assert any(var[1].run_id in n for n in c.notes)  # the repeat is named
    # a succeeded run without a document beside ones that searched: unknown too
    nodoc = compare_capacity([rep(doc(8.0, 8.0, 8.4), i=0), rep(None, i=1)], [var[0]])
    assert nodoc.verdict == "unknown"
    assert nodoc.reason == (
        "variant: 1 of 2 repeats show neither a capacity nor a bound: no capacity document"
    )


def test_a_repeat_with_a_bound_beside_found_ones_makes_the_side_a_bound() -> None:
    ref = [rep(doc(4.0, 4.0, 4.2))]
    # found 8 [8, 8.4] and at least 32: the side is at least 8 (the lower ends' minimum)
    var = [rep(doc(8.0, 8.0, 8.4), i=0), rep(doc(None, 32.0, None, status="at_least_max"), i=1)]
    c = compare_capacity(var, ref)
    assert c.verdict == "higher" and c.statement == "higher: at least 1.90x"
    assert c.ci_low == pytest.approx(8.0 / 4.2) and c.ci_high is None
    assert c.capacity is None and c.ratio is None  # no mean: not every repeat found one
    assert c.interval["variant"] == [8.0, None] and c.bound["variant"] == "lower"
    assert c.bounds == {"variant": "at least 8", "reference": "found 4 [4, 4.2]"}
    # found 4 [4, 4.2] and below 0.5: the reference is below 4.2, the variant found 8
    low_ref = [rep(doc(4.0, 4.0, 4.2), i=0), rep(doc(None, None, 0.5, status="below_min"), i=1)]
    up = compare_capacity([rep(doc(8.0, 8.0, 8.4))], low_ref)
    assert up.verdict == "higher" and up.ci_low == pytest.approx(8.0 / 4.2)
    assert up.bound["reference"] == "upper"
    # the bracket so far of an uncertain / exhausted search counts as what it shows
    for status, bracket, verdict in (
        ("uncertain", (2.0, 16.0), "unknown"),  # [2/4.2, 16/4] contains 1: unfinished
        ("steps_exhausted", (6.0, 9.0), "higher"),  # [6/4.2, 9/4]
    ):
        mixed = [rep(doc(8.0, 8.0, 8.4), i=0), rep(doc(None, *bracket, status=status), i=1)]
        other = compare_capacity(mixed, ref)
        assert other.verdict == verdict and other.ratio is None
        if verdict == "unknown":
            assert other.ci_low is None and other.ci_high is None
            assert other.reason is not None
            assert other.reason.startswith("the ratio is 0.48x to 4.00x, which does not exclude 1")
            continue
        assert other.ci_low == pytest.approx(bracket[0] / 4.2)
        assert other.ci_high == pytest.approx(max(bracket[1], 8.4) / 4.0)
    # at least and below on one side disagree: that side bounds nothing
    split = compare_capacity(
        [rep(doc(None, 32.0, None, status="at_least_max"), i=0),
         rep(doc(None, None, 0.5, status="below_min"), i=1)],
        ref,
    )  # fmt: skip
    assert split.verdict == "unknown" and split.bound["variant"] == "none"
    assert split.reason is not None and split.reason.startswith(
        "variant: its repeats' bounds disagree (at_least_max x1, below_min x1)"
    )


def test_repeats_that_disagree_widen_the_interval_to_their_envelope() -> None:
    # found 2 and found 16 against 4: the mean (9) alone would say "higher"
    var = [rep(doc(2.0, 2.0, 2.2), i=0), rep(doc(16.0, 16.0, 16.8), i=1)]
    ref = [rep(doc(4.0, 4.0, 4.2))]
    c = compare_capacity(var, ref)
    assert c.ratio == pytest.approx(9.0 / 4.0)  # the point estimate: ratio of means
    assert c.ci_low == pytest.approx(2.0 / 4.2) and c.ci_high == pytest.approx(16.8 / 4.0)
    assert c.verdict == "no_change"
    assert c.interval["variant"] == [2.0, 16.8]
    # per device the same way: each repeat's bracket over its own devices
    pd = compare_capacity(
        [rep(doc(2.0, 2.0, 2.2), devices=1, i=0), rep(doc(16.0, 16.0, 16.8), devices=2, i=1)],
        [rep(doc(4.0, 4.0, 4.2), devices=1)],
    )
    assert pd.per_device_ratio == pytest.approx(((2.0 + 8.0) / 2) / 4.0)
    assert pd.per_device_ci_low == pytest.approx(2.0 / 4.2)
    assert pd.per_device_ci_high == pytest.approx(8.4 / 4.0)
    assert pd.per_device_verdict == "no_change"
    assert pd.devices == {"reference": 1, "variant": None}


@pytest.mark.parametrize("bad", [0, 0.0, -3.0, float("nan"), float("inf"), True, "8", None])
def test_a_found_document_without_a_positive_capacity_is_not_found(bad: Any) -> None:
    c = compare_capacity([rep(doc(8.0, 8.0, 8.4))], [rep(doc(bad, 4.0, 4.2))])
    assert c.verdict == "unknown" and c.ratio is None
    assert c.reason == "reference: capacity is not a positive number"
    json.dumps(c.model_dump(mode="json"), allow_nan=False)


def test_an_empty_document_and_a_missing_variable() -> None:
    empty = compare_capacity([rep(doc(8.0, 8.0, 8.4))], [rep({})])
    assert empty.verdict == "unknown"
    assert empty.reason == "reference: no capacity document"
    assert empty.unit == "requests/s"
    nameless = {k: v for k, v in doc(8.0, 8.0, 8.4).items() if k != "variable"}
    c = compare_capacity([rep(nameless)], [rep({**nameless, "capacity": 4.0})])
    assert c.variable is None and c.unit == "unknown unit"
    assert "None" not in json.dumps(c.model_dump(mode="json"))
    # one side names its variable, the other does not: they do not compare
    half = compare_capacity([rep(nameless)], [rep(doc(4.0, 4.0, 4.2))])
    assert half.verdict == "unknown"
    assert half.reason is not None and "request_rate vs unknown" in half.reason


def test_no_bracket_is_unknown_not_false_precision() -> None:
    # found capacities without failing loads above them are lower bounds only: never
    # [2.00, 2.00] from the capacities standing in for the missing ends
    c = compare_capacity([rep(doc(8.0, None, None))], [rep(doc(4.0, None, None))])
    assert c.verdict == "unknown" and c.per_device_verdict == "unknown"
    assert c.reason == (
        "neither side bounds the ratio (variant found 8 [8, –] vs reference found 4 [4, –] "
        "requests/s)"
    )
    assert c.ci_low is None and c.ci_high is None
    assert c.ratio == pytest.approx(2.0)  # measured, but no verdict without an interval
    assert not capacity_regression(c)
    # a stored bracket of no width is no bracket either
    point = compare_capacity([rep(doc(8.0, 8.0, 8.0))], [rep(doc(4.0, 4.0, 4.0))])
    assert point.verdict == "unknown" and point.reason is not None
    assert point.reason.startswith("no bracket")


@pytest.mark.parametrize(
    ("ref_doc", "reason"),
    [
        (doc(None, None, None, status="uncertain"), "reference: uncertain"),
        (doc(None, None, None, status="steps_exhausted"), "reference: steps_exhausted"),
        (doc(None, None, None, status="below_min"), "reference: below_min"),
        (doc(None, None, None, status="at_least_max"), "reference: at_least_max"),
        (doc(None, None, None, status="client_limited"), "reference: client_limited"),
    ],
)
def test_unknown_when_the_reference_shows_nothing(ref_doc: dict[str, Any], reason: str) -> None:
    c = compare_capacity([rep(doc(8.0, 8.0, 8.4))], [rep(ref_doc)])
    assert c.verdict == "unknown" and c.reason == reason
    assert c.ratio is None and c.ci_low is None and c.ci_high is None
    assert c.per_device_ratio is None and c.per_device_verdict == "unknown"
    assert c.reference_capacity is None and c.capacity == 8.0
    assert not capacity_regression(c)


def test_unknown_reasons_for_both_sides_and_missing_searches() -> None:
    none_yet = compare_capacity([], [])
    assert none_yet.verdict == "unknown"
    assert none_yet.reason == (
        "reference: no succeeded run with a capacity search; "
        "variant: no succeeded run with a capacity search"
    )
    # a failed run's document does not count; a succeeded run without one neither
    failed = compare_capacity(
        [rep(doc(8.0, 8.0, 8.4), status="failed"), rep(None)], [rep(doc(4.0, 4.0, 4.2))]
    )
    assert failed.verdict == "unknown"
    assert failed.reason == "variant: no succeeded run with a capacity search"
    mixed = compare_capacity(
        [
            rep(doc(None, status="uncertain"), i=0),
            rep(doc(None, status="uncertain"), i=1),
            rep(doc(None, None, None, status="below_min"), i=2),
        ],
        [rep(doc(4.0, 4.0, 4.2))],
    )
    assert mixed.reason == "variant: uncertain x2, below_min x1"


def test_unknown_when_the_sides_searched_different_variables() -> None:
    c = compare_capacity(
        [rep(doc(8.0, 8.0, 9.0, variable="concurrency"))], [rep(doc(4.0, 4.0, 4.2))]
    )
    assert c.verdict == "unknown" and c.ratio is None
    assert c.reason is not None and "different variables" in c.reason


def test_per_device_ratio_compares_tp2_fairly() -> None:
    # TP=2 on the same two devices as the reference: per device = the plain ratio
    same = compare_capacity(
        [rep(doc(12.0, 12.0, 12.6), devices=2)], [rep(doc(10.0, 10.0, 10.5), devices=2)]
    )
    assert same.per_device_ratio == pytest.approx(same.ratio or 0)
    assert same.devices == {"reference": 2, "variant": 2}
    assert same.capacity_per_device == pytest.approx(6.0)
    # twice the devices for 1.5x the capacity: higher, but lower per device
    more = compare_capacity(
        [rep(doc(15.0, 15.0, 15.5), devices=2)], [rep(doc(10.0, 10.0, 10.5), devices=1)]
    )
    assert more.verdict == "higher"
    assert more.per_device_ratio == pytest.approx(0.75)
    assert more.per_device_verdict == "lower"
    assert more.per_device_ci_low == pytest.approx(15.0 / 10.5 / 2)
    assert more.per_device_ci_high == pytest.approx(15.5 / 10.0 / 2)
    assert more.reference_capacity_per_device == 10.0
    assert more.capacity_per_device == 7.5


def test_missing_bracket_ends_are_bounds_not_the_capacity() -> None:
    # variant found 8 with no failing load above it: at least 8; reference found 4 with
    # no lower end stored: the capacity is the highest passing load, [4, 4.4]
    c = compare_capacity([rep(doc(8.0, 8.0, None))], [rep(doc(4.0, None, 4.4))])
    assert c.interval == {"reference": [4.0, 4.4], "variant": [8.0, None]}
    assert c.verdict == "higher" and c.statement == "higher: at least 1.82x"
    assert c.ci_low == pytest.approx(8.0 / 4.4) and c.ci_high is None
    assert c.ratio == pytest.approx(2.0)  # both found: the means still compare
    assert any("found 8 with no failing load above it: counted as at least 8" in n for n in c.notes)


def test_binding_slo_of_each_side() -> None:
    ref = [rep(doc(4.0, 4.0, 4.2, binding="ttft_ms p99"))]
    var = [
        rep(doc(8.0, 8.0, 8.4, binding="tpot_ms p99"), i=0),
        rep(doc(8.2, 8.2, 8.6, binding="tpot_ms p99"), i=1),
        rep(doc(8.1, 8.1, 8.5, binding="ttft_ms p99"), i=2),
    ]
    c = compare_capacity(var, ref)
    assert c.binding_slo == {"reference": "ttft_ms p99", "variant": "tpot_ms p99"}
    assert any("binding SLO differs" in n for n in c.notes)
    # a side with no found capacity still names the SLO that failed first
    below = side_capacity([rep(doc(None, None, 1.0, status="below_min", binding="e2el_ms p90"))])
    assert below.binding_slo == "e2el_ms p90" and below.capacity is None


def test_dump_is_json_safe_and_has_the_documented_members() -> None:
    c = compare_capacity([rep(doc(8.0, 8.0, 8.4))], [rep(doc(float("nan"), 4.0, 4.2))])
    dumped = c.model_dump(mode="json")
    json.dumps(dumped, allow_nan=False)
    for key in (
        "ratio",
        "ci_low",
        "ci_high",
        "verdict",
        "per_device_ratio",
        "variable",
        "reference_capacity",
        "capacity",
    ):
        assert key in dumped
    # a NaN capacity is no found capacity
    assert dumped["verdict"] == "unknown"


# --------------------------------------------------------------------------- one-sided


def test_at_least_against_found_is_higher_with_its_bound() -> None:
    # the case: "variant at least 24, reference found 8" is one-sided evidence
    var = [rep(doc(None, 24.0, None, status="at_least_max"))]
    c = compare_capacity(var, [rep(doc(8.0, 8.0, 8.4))])
    assert c.verdict == "higher" and c.reason is None
    assert c.statement == "higher: at least 2.86x"
    assert c.ci_low == pytest.approx(24.0 / 8.4) and c.ci_high is None
    assert c.ratio is None and c.capacity is None and c.reference_capacity == 8.0
    assert c.bound == {"reference": "found", "variant": "lower"}
    assert c.bounds == {"reference": "found 8 [8, 8.4]", "variant": "at least 24"}
    assert c.per_device_verdict == "higher" and c.per_device_ci_high is None
    assert not capacity_regression(c)
    json.dumps(c.model_dump(mode="json"), allow_nan=False)


def test_below_min_against_found_is_lower_and_a_regression() -> None:
    c = compare_capacity([rep(doc(None, None, 1.0, status="below_min"))], [rep(doc(4.0, 4.0, 4.2))])
    assert c.verdict == "lower" and c.statement == "lower: at most 0.25x"
    assert c.ci_low is None and c.ci_high == pytest.approx(0.25)
    assert capacity_regression(c)
    # below the variant's min against at least the reference's max: lower
    both = compare_capacity(
        [rep(doc(None, None, 2.0, status="below_min"))],
        [rep(doc(None, 16.0, None, status="at_least_max"))],
    )
    assert both.verdict == "lower" and both.ci_high == pytest.approx(2.0 / 16.0)
    assert capacity_regression(both)
    # and the other way round: higher
    up = compare_capacity(
        [rep(doc(None, 16.0, None, status="client_limited"))],
        [rep(doc(None, None, 2.0, status="below_min"))],
    )
    assert up.verdict == "higher" and up.ci_low == pytest.approx(8.0)


@pytest.mark.parametrize(
    ("var_doc", "ref_doc", "reason"),
    [
        (  # both lower bounds: the ratio can be anything
            doc(None, 24.0, None, status="at_least_max"),
            doc(None, 8.0, None, status="client_limited"),
            "neither side bounds the ratio (variant at least 24 vs reference at least 8 "
            "requests/s)",
        ),
        (  # both upper bounds
            doc(None, None, 1.0, status="below_min"),
            doc(None, None, 2.0, status="below_min"),
            "neither side bounds the ratio (variant below 1 vs reference below 2 requests/s)",
        ),
        (  # a lower bound under the reference's bracket: the bound straddles 1
            doc(None, 4.0, None, status="at_least_max"),
            doc(8.0, 8.0, 8.4),
            "the ratio is at least 0.48x, which does not exclude 1 (variant at least 4 vs "
            "reference found 8 [8, 8.4] requests/s)",
        ),
        (  # an upper bound above the reference's bracket
            doc(None, None, 16.0, status="below_min"),
            doc(8.0, 8.0, 8.4),
            "the ratio is at most 2.00x, which does not exclude 1 (variant below 16 vs "
            "reference found 8 [8, 8.4] requests/s)",
        ),
    ],
)
def test_unknown_only_when_the_bounds_say_nothing(
    var_doc: dict[str, Any], ref_doc: dict[str, Any], reason: str
) -> None:
    c = compare_capacity([rep(var_doc)], [rep(ref_doc)])
    assert c.verdict == "unknown" and c.reason == reason
    assert c.ci_low is None and c.ci_high is None and c.statement is None
    assert not capacity_regression(c)


def test_repeats_of_a_bound_side_take_the_weakest_bound() -> None:
    # every repeat at least something: the side is at least the smallest of them
    var = [
        rep(doc(None, 24.0, None, status="at_least_max"), i=0),
        rep(doc(None, 12.0, None, status="client_limited"), i=1),
        rep(doc(30.0, 30.0, 31.0), i=2),
    ]
    c = compare_capacity(var, [rep(doc(4.0, 4.0, 4.2), i=0), rep(doc(5.0, 5.0, 5.3), i=1)])
    assert c.interval["variant"] == [12.0, None]
    assert c.interval["reference"] == [4.0, 5.3]
    assert c.ci_low == pytest.approx(12.0 / 5.3) and c.verdict == "higher"
    assert c.found == {"reference": 2, "variant": 1}
    # every repeat below something: below the largest of them
    low = compare_capacity(
        [rep(doc(None, None, 1.0, status="below_min"), i=0), rep(doc(1.5, 1.5, 1.6), i=1)],
        [rep(doc(4.0, 4.0, 4.2))],
    )
    assert low.interval["variant"] == [None, 1.6]
    assert low.ci_high == pytest.approx(1.6 / 4.0) and low.verdict == "lower"


def test_a_client_limited_side_names_the_load_generators_ceiling() -> None:
    limited = {**doc(None, 40.0, None, status="client_limited"), "client_ceiling": 45.0}
    c = compare_capacity([rep(limited, i=7)], [rep(doc(8.0, 8.0, 8.4))])
    assert c.verdict == "higher" and c.client_ceiling == {"reference": None, "variant": 45.0}
    (note,) = [n for n in c.notes if "client-limited" in n]
    assert note.startswith("variant: run r7-")
    assert "at least 40 requests/s; the load generator's ceiling here is 45 requests/s" in note
    # an older document without the ceiling says it was not measured
    old = compare_capacity(
        [rep(doc(None, 40.0, None, status="client_limited"))], [rep(doc(8.0, 8.0, 8.4))]
    )
    assert any("ceiling here was not measured" in n for n in old.notes)


def test_per_device_one_sided() -> None:
    # at least 24 on 2 devices against found 8 on 1: per device at least 12 / 8.4
    c = compare_capacity(
        [rep(doc(None, 24.0, None, status="at_least_max"), devices=2)],
        [rep(doc(8.0, 8.0, 8.4), devices=1)],
    )
    assert c.per_device_verdict == "higher"
    assert c.per_device_ci_low == pytest.approx(12.0 / 8.4) and c.per_device_ci_high is None
    assert c.per_device_statement == "higher: at least 1.43x"
    # at least 12 on 4 devices: 3 per device, not above 8.4 -> unknown per device only
    d = compare_capacity(
        [rep(doc(None, 12.0, None, status="at_least_max"), devices=4)],
        [rep(doc(8.0, 8.0, 8.4), devices=1)],
    )
    assert d.verdict == "higher" and d.per_device_verdict == "unknown"
    assert d.per_device_ci_low is None and d.per_device_ci_high is None


def test_a_flagged_run_gives_no_capacity_verdict() -> None:
    flagged = CapacityRepeat(
        run_id="v0",
        capacity=doc(4.0, 4.0, 4.2),
        untrusted="token bursts: 93% of inter-token gaps under 0.1 ms",
    )
    c = compare_capacity([flagged], [rep(doc(8.0, 8.0, 8.4))])
    assert c.verdict == "untrusted" and c.per_device_verdict == "untrusted"
    assert not c.trustworthy and not capacity_regression(c)
    assert (
        c.untrusted_reason == "variant run v0: token bursts: 93% of inter-token gaps under 0.1 ms"
    )
    assert (c.ratio, c.ci_low, c.ci_high, c.statement) == (None, None, None, None)
    assert c.capacity == 4.0 and c.reference_capacity == 8.0  # shown greyed
    # a failed run's flag does not count: it is not compared
    failed = flagged.model_copy(update={"status": "failed", "run_id": "v1"})
    ok = compare_capacity([rep(doc(4.0, 4.0, 4.2)), failed], [rep(doc(8.0, 8.0, 8.4))])
    assert ok.verdict == "lower" and ok.trustworthy


def test_a_bound_just_over_1_never_reads_as_1() -> None:
    # variant at least 10.5126 against a reference found 10 [10, 10.5]: the bound ratio
    # is 1.0012; rounded to 1.00 it would read like the unknown "at least 1.00x"
    reference = [
        CapacityRepeat(
            run_id="r",
            capacity={"variable": "request_rate", "status": "found", "capacity": 10.0}
            | {"interval": [10.0, 10.5]},
        )
    ]
    variant = [
        CapacityRepeat(
            run_id="v",
            capacity={"variable": "request_rate", "status": "at_least_max", "capacity": None}
            | {"interval": [10.5126, None]},
        )
    ]
    comp = compare_capacity(variant, reference)
    assert comp.verdict == "higher" and comp.ci_low == pytest.approx(1.0012)
    assert comp.statement == "higher: at least 1.0012x"
