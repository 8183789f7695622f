"""Capacity under SLOs compared: a variant's capacity against its reference's.

Pure: no database, no Ray, no HTTP. Inputs are :class:`CapacityRepeat` (one
repeat of one variant: its run status, its stored capacity search document and
the devices it reserved); the output is a :class:`CapacityComparison` whose
``model_dump(mode="json")`` is the ``capacity`` member of a variant in
``GET /api/v1/experiments/{id}/comparison``.

The capacity document is a run's ``runs.capacity``, i.e.
``jobs.capacity.CapacityResult.model_dump(mode="json")``: ``variable``
(``request_rate`` | ``concurrency``), ``status`` (``found`` | ``below_min`` |
``at_least_max`` | ``uncertain`` | ``steps_exhausted``), ``capacity`` (the
highest load that met every objective), ``interval`` ``[lo, hi]`` (the bracket:
highest passing load .. lowest failing load), ``binding_slo``, ``steps``. It is
read here as a plain mapping (this room imports nothing of ``jobs``).

What is computed:

- per side, over its **usable** repeats (run ``succeeded`` with a capacity
  document whose ``status`` is ``found`` and whose ``capacity`` is a positive
  number): the mean capacity, the mean bracket ends (a missing end counts as the
  capacity itself, and a note says so), and the mean capacity per device
  (capacity / devices the run reserved, per repeat, then the mean);
- ``ratio`` = variant mean capacity / reference mean capacity;
- the interval ``[ci_low, ci_high]`` = ``[lo_v / hi_r, hi_v / lo_r]`` from the
  mean bracket ends: every ratio the two searches' brackets allow. It reflects
  the searches' resolution (their ``tolerance``), not a bootstrap over requests
  nor run-to-run drift; a note says when the repeats of a side spread wider than
  their bracket;
- ``verdict``: ``higher`` when ``ci_low > 1``, ``lower`` when ``ci_high < 1``,
  ``no_change`` when the interval contains 1, ``unknown`` when either side has
  no usable repeat (``reason`` says why: e.g. ``"reference: uncertain"``) or the
  sides searched different variables. ``unknown`` never carries a number that
  was not measured: a side whose search ended ``below_min`` or ``at_least_max``
  has no capacity, only a bound, and the reason quotes it;
- ``per_device_ratio`` (with its interval and verdict, the brackets divided by
  devices): so TP=2 on the same two devices compares fairly with TP=1 on two
  devices, and a variant that reserves more devices must raise capacity by more than the device
  count to raise it per device.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

CapacityVerdict = Literal["higher", "lower", "no_change", "unknown"]

#: The unit of a capacity, by search variable (for tables and regressions).
UNITS: dict[str, str] = {"request_rate": "requests/s", "concurrency": "concurrent requests"}


class CapacityRepeat(BaseModel):
    """One repeat of one variant: run status, ``runs.capacity`` (or None), devices reserved."""

    run_id: str
    status: str = "succeeded"
    capacity: dict[str, Any] | None = None
    devices: int = Field(1, ge=1)


class SideCapacity(BaseModel):
    """One side's capacity over its usable repeats (``None``: no usable repeat)."""

    variable: str | None = None
    capacity: float | None = None
    low: float | None = None
    high: float | None = None
    per_device: float | None = None
    devices: int | None = Field(None, description="devices reserved, when every repeat agrees")
    found: int = 0
    searched: int = Field(0, description="succeeded repeats with a capacity document")
    statuses: dict[str, int] = Field(default_factory=dict)
    binding_slo: str | None = None
    notes: list[str] = Field(default_factory=list)


class CapacityComparison(BaseModel):
    """A variant's capacity against its reference's (see the module docstring).

    ``capacity`` / ``reference_capacity``: mean capacity of found repeats, in the
    variable's unit (``unit``). ``ratio`` and ``[ci_low, ci_high]``: variant /
    reference with the interval from the brackets. ``per_device_ratio`` and
    ``[per_device_ci_low, per_device_ci_high]`` and ``per_device_verdict``: the same
    per reserved device (interval and verdict only when each side's repeats agree on
    their device count).
    ``binding_slo``, ``found``, ``devices``, ``interval``: per side
    (``{"reference": ..., "variant": ...}``). ``reason``: why the verdict is
    ``unknown``; ``notes``: caveats.
    """

    variable: str | None = None
    unit: str | None = None
    capacity: float | None = None
    reference_capacity: float | None = None
    ratio: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    verdict: CapacityVerdict = "unknown"
    capacity_per_device: float | None = None
    reference_capacity_per_device: float | None = None
    per_device_ratio: float | None = None
    per_device_ci_low: float | None = None
    per_device_ci_high: float | None = None
    per_device_verdict: CapacityVerdict = "unknown"
    interval: dict[str, list[float | None]] = Field(default_factory=dict)
    binding_slo: dict[str, str | None] = Field(default_factory=dict)
    found: dict[str, int] = Field(default_factory=dict)
    devices: dict[str, int | None] = Field(default_factory=dict)
    reason: str | None = None
    notes: list[str] = Field(default_factory=list)


def _num(x: Any) -> float | None:
    """A finite float, else None."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    f = float(x)
    return f if math.isfinite(f) else None


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _bound_text(status: str, doc: Mapping[str, Any]) -> str:
    """A search status with the bound or bracket it measured, if any (``below_min (below
    0.5)``, ``at_least_max (at least 16)``, ``uncertain (between 4 and 8)``)."""
    lo, hi = _interval(doc)
    if status == "below_min" and hi is not None:
        return f"{status} (below {hi:g})"
    if status == "at_least_max" and lo is not None:
        return f"{status} (at least {lo:g})"
    if status in ("uncertain", "steps_exhausted") and lo is not None and hi is not None:
        return f"{status} (between {lo:g} and {hi:g})"
    return status


def _interval(doc: Mapping[str, Any]) -> tuple[float | None, float | None]:
    iv = doc.get("interval")
    if not isinstance(iv, list | tuple) or len(iv) != 2:
        return None, None
    return _num(iv[0]), _num(iv[1])


def side_capacity(repeats: Sequence[CapacityRepeat], label: str = "side") -> SideCapacity:
    """Mean capacity, bracket and capacity per device of one side's usable repeats.

    ``label`` names the side in notes (``"reference"`` / ``"variant"``). Usable: run
    ``succeeded``, capacity document with ``status == "found"`` and a positive
    ``capacity``. Bracket ends are averaged over usable repeats; a missing (or
    inverted) end counts as that repeat's capacity, with a note.
    """
    searched = [r for r in repeats if r.status == "succeeded" and r.capacity is not None]
    statuses: Counter[str] = Counter(str((r.capacity or {}).get("status")) for r in searched)
    variables = {str((r.capacity or {}).get("variable")) for r in searched}
    usable: list[tuple[CapacityRepeat, float]] = []
    for r in searched:
        doc = r.capacity or {}
        cap = _num(doc.get("capacity"))
        if doc.get("status") == "found" and cap is not None and cap > 0:
            usable.append((r, cap))
    out = SideCapacity(
        variable=next(iter(variables)) if len(variables) == 1 else None,
        searched=len(searched),
        found=len(usable),
        statuses=dict(statuses),
    )
    if len(variables) > 1:
        out.notes.append(f"{label}: repeats searched different variables ({sorted(variables)})")
    bindings = Counter(
        str(b)
        for b in (
            (r.capacity or {}).get("binding_slo") for r in ([u for u, _ in usable] or searched)
        )
        if b
    )
    if bindings:
        out.binding_slo = bindings.most_common(1)[0][0]
        if len(bindings) > 1:
            each = ", ".join(f"{b} x{n}" for b, n in bindings.most_common())
            out.notes.append(f"{label}: the binding SLO differs between repeats ({each})")
    if not usable:
        return out
    caps = [c for _, c in usable]
    lows, highs, filled = [], [], 0
    for r, cap in usable:
        lo, hi = _interval(r.capacity or {})
        if lo is None or lo > cap:
            lo, filled = cap, filled + 1
        if hi is None or hi < cap:
            hi, filled = cap, filled + 1
        lows.append(lo)
        highs.append(hi)
    out.capacity = _mean(caps)
    out.low, out.high = _mean(lows), _mean(highs)
    out.per_device = _mean([cap / r.devices for r, cap in usable])
    devices = {r.devices for r, _ in usable}
    out.devices = next(iter(devices)) if len(devices) == 1 else None
    if filled:
        out.notes.append(
            f"{label}: {filled} bracket end(s) unknown; the capacity stands in for them, "
            "so the interval is narrower than the search could tell"
        )
    if len(caps) > 1 and max(caps) - min(caps) > out.high - out.low:
        out.notes.append(
            f"{label}: repeats' capacities spread {min(caps):.4g}..{max(caps):.4g}, wider than "
            "the bracket; the interval does not cover this run-to-run drift"
        )
    if len(usable) < len(searched):
        others = Counter(
            str((r.capacity or {}).get("status"))
            for r in searched
            if r.run_id not in {u.run_id for u, _ in usable}
        )
        each = ", ".join(f"{s} x{n}" for s, n in others.most_common())
        out.notes.append(
            f"{label}: {len(searched) - len(usable)} repeat(s) without a found capacity "
            f"({each}) left out of the mean"
        )
    return out


def _unknown_reason(label: str, side: SideCapacity, repeats: Sequence[CapacityRepeat]) -> str:
    if not side.searched:
        return f"{label}: no succeeded run with a capacity search"
    docs = [r.capacity or {} for r in repeats if r.status == "succeeded" and r.capacity]
    texts = Counter(_bound_text(str(d.get("status")), d) for d in docs)
    if len(texts) == 1:
        return f"{label}: {next(iter(texts))}"
    return f"{label}: " + ", ".join(f"{t} x{n}" for t, n in texts.most_common())


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    r = a / b
    return r if math.isfinite(r) else None


def _verdict(lo: float | None, hi: float | None) -> CapacityVerdict:
    if lo is None or hi is None:
        return "unknown"
    if lo > 1.0:
        return "higher"
    if hi < 1.0:
        return "lower"
    return "no_change"


def compare_capacity(
    variant: Sequence[CapacityRepeat], reference: Sequence[CapacityRepeat]
) -> CapacityComparison:
    """The variant's capacity against its reference's: ratio, bracket interval, verdict.

    Ratios are variant / reference of the sides' mean capacities (over found
    repeats); ``[ci_low, ci_high] = [lo_v / hi_r, hi_v / lo_r]`` with the sides'
    mean bracket ends. Per device: the same with each repeat's capacity and
    bracket divided by the devices it reserved. ``unknown`` (with ``reason``)
    when a side has no found capacity or the sides searched different variables.
    """
    v = side_capacity(variant, "variant")
    r = side_capacity(reference, "reference")
    out = CapacityComparison(
        variable=v.variable or r.variable,
        capacity=v.capacity,
        reference_capacity=r.capacity,
        capacity_per_device=v.per_device,
        reference_capacity_per_device=r.per_device,
        interval={"reference": [r.low, r.high], "variant": [v.low, v.high]},
        binding_slo={"reference": r.binding_slo, "variant": v.binding_slo},
        found={"reference": r.found, "variant": v.found},
        devices={"reference": r.devices, "variant": v.devices},
        notes=r.notes + v.notes,
    )
    out.unit = UNITS.get(out.variable or "")
    reasons = []
    if r.capacity is None:
        reasons.append(_unknown_reason("reference", r, reference))
    if v.capacity is None:
        reasons.append(_unknown_reason("variant", v, variant))
    if not reasons and v.variable != r.variable:
        reasons.append(
            f"the sides searched different variables ({r.variable} vs {v.variable}); "
            "their capacities do not compare"
        )
    if reasons:
        out.reason = "; ".join(reasons)
        return out
    assert v.low is not None and v.high is not None and r.low is not None and r.high is not None
    out.ratio = _ratio(v.capacity, r.capacity)
    out.ci_low, out.ci_high = _ratio(v.low, r.high), _ratio(v.high, r.low)
    out.verdict = _verdict(out.ci_low, out.ci_high)
    out.per_device_ratio = _ratio(v.per_device, r.per_device)
    if v.devices is not None and r.devices is not None:
        scale = r.devices / v.devices
        out.per_device_ci_low = out.ci_low * scale if out.ci_low is not None else None
        out.per_device_ci_high = out.ci_high * scale if out.ci_high is not None else None
        out.per_device_verdict = _verdict(out.per_device_ci_low, out.per_device_ci_high)
    if min(v.found, r.found) < 2:
        out.notes.append(
            "one found repeat on a side: the interval is the searches' bracket only "
            "(their tolerance), not run-to-run drift"
        )
    return out


def capacity_regression(comp: CapacityComparison) -> bool:
    """A capacity drop: the verdict is ``lower`` (the whole interval below 1)."""
    return comp.verdict == "lower"
