"""What counts as a regression: a worse verdict whose size passes a practical floor.

A comparison's verdict (:func:`orchestrator.analysis.compare.compare_variant`) is
``worse`` whenever the 95 % bootstrap interval of the ratio variant / reference lies
wholly on the bad side of 1: statistically right, but with many requests a negligible
change is ``worse`` too (a TPOT of 10.00 -> 10.02 ms, 0.2 %, with a tight interval). The
verdict stays what the statistics say (tables keep saying ``worse``); what acts on it,
``vlab compare``'s exit code and a scheduled sweep's regressions, asks this module.

The rule, as asv (airspeed velocity) gates a regression on significance *and* its
``--factor``: a metric is a regression only when its verdict is ``worse`` **and** its
point ratio lies at least ``min_change`` beyond 1 in the bad direction:

- lower is better (latencies, the waiting queue): ``ratio >= 1 + min_change``;
- higher is better (throughputs, goodput, hit rate): ``ratio <= 1 / (1 + min_change)``,
  the same relative step the other way (5 %: 100 -> 95.2 tok/s);
- neutral metrics are never ``worse``, so never a regression.

A ``worse`` verdict with no ratio (the reference is 0, the interval is of the
difference) is a regression: no relative size can be small. ``min_change`` 0 restores
"every worse verdict is a regression". A capacity (:func:`orchestrator.analysis.
capacity_compare.capacity_regression`) is higher-is-better: a ``lower`` verdict is a
regression when its ratio of the means, or where a side is only a bound (no ratio) the
interval's upper end, is at or below ``1 / (1 + min_change)``.

Every consumer (the CLI's ``vlab compare``, :func:`orchestrator.schedules.service.
sweep_regressions`) calls :func:`is_regression` / :func:`capacity_is_regression`; none
keeps its own threshold. Pure: no numpy (the command line imports it), no database.
"""

from __future__ import annotations

import math

#: The default regression floor: a worse change smaller than this fraction (5 %) of the
#: reference is not a regression (``vlab compare --min-change``; scheduled sweeps use it).
MIN_CHANGE = 0.05

#: Slack for a ratio exactly at the floor (``1.05`` computed as ``105 / 100``).
_AT_FLOOR = 1e-9


def bad_change(direction: str, ratio: float | None) -> float | None:
    """The size of a change in the bad direction, as a fraction: ``ratio - 1`` for a
    lower-is-better metric, ``1 / ratio - 1`` for a higher-is-better one (a capacity
    too); negative when the ratio lies on the good side; None without a finite ratio or
    for a neutral metric. The floor compares with this number."""
    if ratio is None or not math.isfinite(ratio):
        return None
    if direction == "lower_is_better":
        return ratio - 1.0
    if direction == "higher_is_better":
        return math.inf if ratio <= 0 else 1.0 / ratio - 1.0
    return None


def past_floor(direction: str, ratio: float | None, min_change: float = MIN_CHANGE) -> bool:
    """Whether ``ratio`` lies at least ``min_change`` beyond 1 in ``direction``'s bad
    direction (at the floor counts); False for a neutral metric or without a ratio."""
    change = bad_change(direction, ratio)
    return change is not None and change >= min_change - _AT_FLOOR


def is_regression(
    direction: str, verdict: str, ratio: float | None, min_change: float = MIN_CHANGE
) -> bool:
    """A metric comparison that is a regression: verdict ``worse`` and the point ratio
    past the floor (module docstring). ``direction``, ``verdict``, ``ratio``: a
    :class:`orchestrator.analysis.compare.MetricComparison`'s (or its JSON's)."""
    if verdict != "worse":
        return False
    if min_change <= 0 or ratio is None:
        return True
    return past_floor(direction, ratio, min_change)


def capacity_size(ratio: float | None, ci_high: float | None) -> float | None:
    """The ratio a capacity's floor is checked on: the ratio of the means, or where a
    side is only a bound (no ratio) the interval's upper end."""
    return ratio if ratio is not None else ci_high


def capacity_is_regression(
    verdict: str, ratio: float | None, ci_high: float | None, min_change: float = MIN_CHANGE
) -> bool:
    """A capacity comparison that is a regression: verdict ``lower`` and its
    :func:`capacity_size` at or below ``1 / (1 + min_change)`` (``ratio``, ``ci_high``:
    a :class:`orchestrator.analysis.capacity_compare.CapacityComparison`'s)."""
    if verdict != "lower":
        return False
    size = capacity_size(ratio, ci_high)
    if min_change <= 0 or size is None:
        return True
    return past_floor("higher_is_better", size, min_change)


def drop(direction: str, ratio: float | None) -> float | None:
    """The size of a change as a person reads "worse by X %", as a fraction: the rise
    ``ratio - 1`` for a lower-is-better metric, the drop ``1 - ratio`` for a
    higher-is-better one (a capacity too: a throughput ratio 0.96 is a 4 % drop);
    negative when the ratio lies on the good side; None without a finite ratio or for a
    neutral metric. What is printed; the floor compares :func:`bad_change` (for a
    higher-is-better metric the 5 % floor is a drop of 4.76 %: a ratio at most 1 / 1.05)."""
    if ratio is None or not math.isfinite(ratio):
        return None
    if direction == "lower_is_better":
        return ratio - 1.0
    if direction == "higher_is_better":
        return 1.0 - ratio
    return None


def floor_drop(direction: str, min_change: float) -> float:
    """The :func:`drop` the floor ``min_change`` is: ``min_change`` itself for a
    lower-is-better metric, ``1 - 1 / (1 + min_change)`` for a higher-is-better one
    (5 %: a drop of 4.76 %)."""
    if direction == "higher_is_better":
        return 1.0 - 1.0 / (1.0 + min_change)
    return min_change


def percents_apart(size: float, floor: float) -> tuple[str, str]:
    """``size`` and ``floor`` (fractions, ``size`` below ``floor``) as percentages that
    never read as equal: ``("4.96 %", "5 %")`` for 0.0496 and 0.05, not ``5.0 %`` and
    ``5 %``; each as :func:`percent` writes it where that already tells them apart, else
    with as many decimals as it takes (the floor whole where it is a whole percent)."""
    size_text, floor_text = percent(size), percent(floor)
    whole = floor_text if "." not in floor_text else None
    for decimals in range(2, 10):
        if float(size_text.split()[0]) < float(floor_text.split()[0]):
            return size_text, floor_text
        size_text = f"{100.0 * size:.{decimals}f} %"
        floor_text = whole or f"{100.0 * floor:.{decimals}f} %"
    return f"just under {floor_text}", floor_text


def percent(fraction: float) -> str:
    """``0.2 %``, ``5 %``, ``0.012 %``: a fraction as a percentage for a sentence."""
    pct = 100.0 * fraction
    if not math.isfinite(pct):
        return f"{pct} %"
    if abs(pct - round(pct)) < 1e-9:
        return f"{pct:.0f} %"
    return f"{pct:.1f} %" if abs(pct) >= 0.1 else f"{pct:.2g} %"
