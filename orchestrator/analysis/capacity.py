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

- a repeat **found** a capacity when its run ``succeeded`` with a capacity
  document whose ``status`` is ``found`` and whose ``capacity`` is a finite
  positive number. Otherwise it did not, and why is said: its status with the
  bound it measured (``uncertain (between 2 and 16)``, ``below_min (below
  0.5)``, ``at_least_max (at least 32)``), ``capacity is not a positive number``
  (a ``found`` document with 0, a negative, NaN, infinity or a non-number),
  ``no capacity document`` (an empty one, or none on a succeeded run of a side
  whose other runs searched);
- a side has a capacity only when **every** succeeded repeat found one: the mean
  capacity, the **envelope** of the repeats' brackets ``[min lo, max hi]`` (a
  missing or inverted end counts as that repeat's capacity, and a note says so)
  and the mean capacity per device (capacity / devices the run reserved);
- ``ratio`` = variant mean capacity / reference mean capacity;
- the interval ``[ci_low, ci_high]`` = ``[min lo_v / max hi_r, max hi_v /
  min lo_r]`` over the repeats' brackets: every ratio the searches' brackets and
  the repeats' spread allow (the searches' resolution, their ``tolerance``, plus
  run-to-run drift as far as the repeats show it). It is not a bootstrap
  confidence interval;
- ``verdict``: ``higher`` when ``ci_low > 1``, ``lower`` when ``ci_high < 1``,
  ``no_change`` when the interval contains 1, ``unknown`` (``reason`` says why)
  when a side has a succeeded repeat without a found capacity (the reason names
  those repeats' outcomes: e.g. ``"reference: uncertain"``, ``"variant: 1 of 2
  repeats found no capacity: uncertain (between 2 and 16)"``), when the sides (or
  a side's repeats) searched different variables, or when the interval has no
  width (``"no bracket ..."``: the documents stored no bracket ends, so a verdict
  would be false precision). ``unknown`` never carries a number that was not
  measured: a side whose search ended ``below_min`` or ``at_least_max`` has no
  capacity, only a bound, and the reason quotes it;
- ``per_device_ratio`` (with its interval and verdict, the same envelope over
  each repeat's bracket divided by its devices): so TP=2 on the same two devices
  compares fairly with TP=1 on two devices, and a variant that reserves more
  devices must raise capacity by more than the device count to raise it per
  device.
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

#: The unit shown when the documents name no (known) search variable.
UNKNOWN_UNIT = "unknown unit"

NOT_POSITIVE = "capacity is not a positive number"
NO_DOCUMENT = "no capacity document"
NO_BRACKET = (
    "no bracket: the searches stored no interval around their capacities, "
    "so the ratio's interval has no width and a verdict would be false precision"
)


class CapacityRepeat(BaseModel):
    """One repeat of one variant: run status, ``runs.capacity`` (or None), devices reserved."""

    run_id: str
    status: str = "succeeded"
    capacity: dict[str, Any] | None = None
    devices: int = Field(1, ge=1)


class SideCapacity(BaseModel):
    """One side's capacity: numbers only when every succeeded repeat found a capacity.

    ``low`` / ``high``: the envelope of the repeats' brackets (``per_device_low`` /
    ``per_device_high`` the same per reserved device). ``missing``: the succeeded
    repeats that found no capacity, counted by why."""

    variable: str | None = None
    mixed_variables: bool = False
    capacity: float | None = None
    low: float | None = None
    high: float | None = None
    per_device: float | None = None
    per_device_low: float | None = None
    per_device_high: float | None = None
    devices: int | None = Field(None, description="devices reserved, when every repeat agrees")
    found: int = 0
    searched: int = Field(0, description="succeeded repeats with a capacity document")
    succeeded: int = 0
    statuses: dict[str, int] = Field(default_factory=dict)
    missing: dict[str, int] = Field(default_factory=dict)
    binding_slo: str | None = None
    notes: list[str] = Field(default_factory=list)


class CapacityComparison(BaseModel):
    """A variant's capacity against its reference's (see the module docstring).

    ``capacity`` / ``reference_capacity``: mean capacity of the repeats (only when
    every repeat of the side found one), in the variable's unit (``unit``).
    ``ratio`` and ``[ci_low, ci_high]``: variant / reference, the interval the
    envelope of the repeats' brackets. ``per_device_ratio`` and
    ``[per_device_ci_low, per_device_ci_high]`` and ``per_device_verdict``: the same
    per reserved device. ``binding_slo``, ``found``, ``devices``, ``interval``
    (each side's bracket envelope): per side (``{"reference": ..., "variant": ...}``).
    ``reason``: why the verdict is ``unknown``; ``notes``: caveats.
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
    """A finite float, else None (``True`` is not a number here)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    f = float(x)
    return f if math.isfinite(f) else None


def _positive(x: Any) -> float | None:
    """A finite positive float, else None."""
    f = _num(x)
    return f if f is not None and f > 0 else None


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


def _variable(doc: Mapping[str, Any] | None) -> str | None:
    v = (doc or {}).get("variable")
    return v if isinstance(v, str) and v else None


def repeat_problem(doc: Mapping[str, Any] | None) -> str | None:
    """Why a succeeded repeat's document gives no capacity; None when it found one."""
    if not doc:
        return NO_DOCUMENT
    status = doc.get("status")
    if status == "found":
        return None if _positive(doc.get("capacity")) is not None else NOT_POSITIVE
    if not isinstance(status, str) or not status:
        return "no search status"
    return _bound_text(status, doc)


def side_capacity(repeats: Sequence[CapacityRepeat], label: str = "side") -> SideCapacity:
    """One side's capacity: mean, bracket envelope and capacity per device.

    ``label`` names the side in notes (``"reference"`` / ``"variant"``). Numbers
    only when every succeeded repeat found a capacity (``missing`` is empty and
    ``searched`` > 0); a missing (or inverted) bracket end counts as that repeat's
    capacity, with a note.
    """
    succeeded = [r for r in repeats if r.status == "succeeded"]
    searched = [r for r in succeeded if r.capacity is not None]
    statuses: Counter[str] = Counter(
        str((r.capacity or {}).get("status") or "none") for r in searched
    )
    variables = {_variable(r.capacity) for r in searched}
    out = SideCapacity(
        variable=next(iter(variables)) if len(variables) == 1 else None,
        mixed_variables=len(variables) > 1,
        searched=len(searched),
        succeeded=len(succeeded),
        statuses=dict(statuses),
    )
    if out.mixed_variables:
        names = sorted(v or "none" for v in variables)
        out.notes.append(f"{label}: repeats searched different variables ({names})")
    if not searched:
        return out
    usable: list[tuple[CapacityRepeat, float]] = []
    missing: Counter[str] = Counter()
    missing_runs: dict[str, list[str]] = {}
    for r in succeeded:
        problem = repeat_problem(r.capacity)
        if problem is None:
            cap = _positive((r.capacity or {}).get("capacity"))
            assert cap is not None
            usable.append((r, cap))
        else:
            missing[problem] += 1
            missing_runs.setdefault(problem, []).append(r.run_id)
    out.found = len(usable)
    out.missing = dict(missing)
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
    if missing:
        runs = "; ".join(f"{p}: {', '.join(ids)}" for p, ids in missing_runs.items())
        out.notes.append(f"{label}: repeats without a found capacity ({runs})")
        if usable:
            found = ", ".join(f"{c:.4g}" for _, c in usable)
            out.notes.append(
                f"{label}: {len(usable)} of {len(succeeded)} repeats found a capacity "
                f"({found}); a side has a capacity only when every repeat found one"
            )
        return out
    caps = [c for _, c in usable]
    lows, highs, filled = [], [], 0
    for r, cap in usable:
        lo, hi = _interval(r.capacity or {})
        if lo is None or lo > cap:
            lo, filled = cap, filled + 1
        if hi is None or hi < cap:
            hi, filled = cap, filled + 1
        lows.append((lo, lo / r.devices))
        highs.append((hi, hi / r.devices))
    out.capacity = _mean(caps)
    out.low, out.high = min(lo for lo, _ in lows), max(hi for hi, _ in highs)
    out.per_device_low = min(lo for _, lo in lows)
    out.per_device_high = max(hi for _, hi in highs)
    out.per_device = _mean([cap / r.devices for r, cap in usable])
    devices = {r.devices for r, _ in usable}
    out.devices = next(iter(devices)) if len(devices) == 1 else None
    if filled:
        out.notes.append(
            f"{label}: {filled} bracket end(s) unknown; the capacity stands in for them, "
            "so the interval is narrower than the search could tell"
        )
    if len(caps) > 1 and max(caps) > min(caps):
        out.notes.append(
            f"{label}: repeats' capacities spread {min(caps):.4g}..{max(caps):.4g}; the "
            f"interval is the envelope of their brackets [{out.low:.4g}, {out.high:.4g}]"
        )
    return out


def _unknown_reason(label: str, side: SideCapacity) -> str:
    if not side.searched:
        return f"{label}: no succeeded run with a capacity search"
    texts = Counter(side.missing)
    each = ", ".join(f"{t} x{n}" if len(texts) > 1 else t for t, n in texts.most_common())
    if not side.found:
        return f"{label}: {each}"
    return f"{label}: {sum(texts.values())} of {side.succeeded} repeats found no capacity: {each}"


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


def _no_width(lo: float | None, hi: float | None) -> bool:
    """An interval that is a point (or inverted): no bracket around the ratio."""
    return lo is not None and hi is not None and hi - lo <= 1e-12 * max(1.0, abs(hi))


def compare_capacity(
    variant: Sequence[CapacityRepeat], reference: Sequence[CapacityRepeat]
) -> CapacityComparison:
    """The variant's capacity against its reference's: ratio, bracket interval, verdict.

    Ratios are variant / reference of the sides' mean capacities; ``[ci_low,
    ci_high] = [min lo_v / max hi_r, max hi_v / min lo_r]`` over the repeats'
    brackets (the envelope). Per device: the same with each repeat's capacity and
    bracket divided by the devices it reserved. ``unknown`` (with ``reason``) unless
    every succeeded repeat of both sides found a capacity, when the sides searched
    different variables, or when the interval has no width (no bracket).
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
    out.unit = UNITS.get(out.variable or "", UNKNOWN_UNIT)
    reasons = []
    if r.capacity is None:
        reasons.append(_unknown_reason("reference", r))
    if v.capacity is None:
        reasons.append(_unknown_reason("variant", v))
    if not reasons and (v.variable != r.variable or v.mixed_variables or r.mixed_variables):
        reasons.append(
            f"the sides searched different variables ({r.variable or 'unknown'} vs "
            f"{v.variable or 'unknown'}); their capacities do not compare"
        )
    if reasons:
        out.reason = "; ".join(reasons)
        return out
    out.ratio = _ratio(v.capacity, r.capacity)
    out.per_device_ratio = _ratio(v.per_device, r.per_device)
    ci_low, ci_high = _ratio(v.low, r.high), _ratio(v.high, r.low)
    pd_low = _ratio(v.per_device_low, r.per_device_high)
    pd_high = _ratio(v.per_device_high, r.per_device_low)
    if out.ratio is None or ci_low is None or ci_high is None:
        out.reason = "the capacities give no finite ratio"
        return out
    if _no_width(ci_low, ci_high):
        out.reason = NO_BRACKET
        return out
    out.ci_low, out.ci_high = ci_low, ci_high
    out.verdict = _verdict(ci_low, ci_high)
    if out.per_device_ratio is not None and not _no_width(pd_low, pd_high):
        out.per_device_ci_low, out.per_device_ci_high = pd_low, pd_high
        out.per_device_verdict = _verdict(pd_low, pd_high)
    if min(v.found, r.found) < 2:
        out.notes.append(
            "one found repeat on a side: the interval is the searches' bracket only "
            "(their tolerance), not run-to-run drift"
        )
    return out


def capacity_regression(comp: CapacityComparison) -> bool:
    """A capacity drop: the verdict is ``lower`` (the whole interval below 1)."""
    return comp.verdict == "lower"
