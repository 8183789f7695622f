"""Capacity under SLOs compared: a variant's capacity against its reference's.

Pure: no database, no Ray, no HTTP. Inputs are :class:`CapacityRepeat` (one
repeat of one variant: its run status, its stored capacity search document, the
devices it reserved, and why its capacity is not to be trusted, if a flag of the
run taints it: :mod:`orchestrator.analysis.trust`); the output is a
:class:`CapacityComparison` whose ``model_dump(mode="json")`` is the ``capacity``
member of a variant in ``GET /api/v1/experiments/{id}/comparison``.

The capacity document is a run's ``runs.capacity``, i.e.
``jobs.capacity.search.CapacityResult.model_dump(mode="json")``: ``variable``
(``request_rate`` | ``concurrency``), ``status`` (``found`` | ``below_min`` |
``at_least_max`` | ``client_limited`` | ``uncertain`` | ``steps_exhausted``),
``capacity`` (the highest load that met every objective, ``found`` only),
``interval`` ``[lo, hi]`` (highest passing load .. lowest failing load, either end
None when no step showed it), ``client_ceiling`` (the highest rate the load
generator sustains there, newer documents), ``binding_slo``, ``steps``. It is read
here as a plain mapping (this room imports nothing of ``jobs``), with ``.get``.

**What a repeat shows** (the evidence, an interval the true capacity lies in; None is
no bound on that side):

- ``found``: ``[lo, hi]`` with ``lo`` = the capacity (the highest passing load; a
  stored ``lo`` below it is kept) and ``hi`` the lowest failing load. A found capacity
  whose search stored no failing load above it (``hi`` missing or below the capacity)
  shows only "at least the capacity": the capacity never stands in for a missing end,
  so no interval gets zero width from a constant filled in;
- ``at_least_max`` and ``client_limited``: a **lower bound**, ``[lo, None]``: the
  highest passing load (``client_limited``: the load generator could not deliver more;
  the note names its ceiling, ``client_ceiling``);
- ``below_min``: an **upper bound**, ``[None, hi]``: below the lowest load tried;
- ``uncertain`` and ``steps_exhausted``: their bracket so far (each end only where a
  step passed / failed);
- nothing (the repeat has no capacity and the side's verdict is ``unknown``): no
  document on a succeeded run of a side whose other runs searched, no search status,
  a ``found`` whose capacity is not a positive number, a status with no bound stored.

**A side** (the succeeded repeats; failed runs are not compared): the envelope of its
repeats' intervals, ``low = min lo``, ``high = max hi``, an end None as soon as one
repeat has no bound on that side. So a side is a lower bound when every repeat shows
at least something (found or at least) and one shows no upper end: e.g. found 8 [8,
8.4] and at least 32 give "at least 8"; found repeats and below-min repeats give "below
the highest hi"; at-least and below-min repeats on one side give nothing (they
disagree, the envelope is unbounded both ways). ``capacity`` (the mean) and the ratio's
point estimate exist only when **every** repeat found a capacity. Per device the same
with each repeat's ends divided by the devices it reserved.

**The comparison**: ``ratio`` = variant mean / reference mean (both found); the
interval ``[ci_low, ci_high] = [low_v / high_r, high_v / low_r]``, an end None where a
side's envelope has none: every ratio the searches' brackets, their bounds and the
repeats' spread allow (not a bootstrap confidence interval). ``verdict``:

- both ends: ``higher`` when ``ci_low > 1``, ``lower`` when ``ci_high < 1``, else
  ``no_change`` when both sides found a capacity and ``unknown`` when a side only
  bracketed it (an unfinished search around 1 says nothing); an interval of no width is
  ``unknown`` (:data:`NO_BRACKET`);
- one end (a side is a bound): ``higher`` when ``ci_low > 1`` ("higher: at least
  2.86x", ``ci_high`` None), ``lower`` when ``ci_high < 1`` ("lower: at most 0.25x",
  ``ci_low`` None), else ``unknown``: the bound straddles 1, nothing follows;
- no end (e.g. both sides lower bounds): ``unknown``;
- ``unknown`` also when a side's repeat shows nothing (the reason names those repeats'
  outcomes: ``"reference: uncertain"``, ``"variant: 1 of 2 repeats show neither a
  capacity nor a bound: no capacity document"``) or the sides searched different
  variables;
- ``untrusted`` (``untrusted_reason``) when a flag of a compared run taints its capacity
  (token bursts under a TPOT or ITL objective, a warm prefix cache): the capacities and
  bounds are shown, no ratio, no interval.

``statement`` says the verdict with its number in words; ``bounds`` what each side
showed (``found 8 [7.5, 8.4]``, ``at least 24``, ``below 1``). The per-device ratio,
interval, verdict and statement are the same over per-device ends: TP=2 on the same two
devices compares fairly with TP=1 on two devices, and a variant that reserves more
devices must raise capacity by more than the device count to raise it per device.
:func:`capacity_regression` is a ``lower`` verdict, one-sided or not, never an
``unknown`` or ``untrusted`` one, whose drop passes the regression floor
(:mod:`orchestrator.analysis.regression`: 5 % by default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from orchestrator.analysis.regression import MIN_CHANGE, capacity_is_regression
from orchestrator.analysis.trust import finite_number

CapacityVerdict = Literal["higher", "lower", "no_change", "unknown", "untrusted"]

#: The unit of a capacity, by search variable (for tables and regressions).
UNITS: dict[str, str] = {"request_rate": "requests/s", "concurrency": "concurrent requests"}

#: The unit shown when the documents name no (known) search variable.
UNKNOWN_UNIT = "unknown unit"

#: Statuses whose document shows a lower bound only (the highest passing load).
LOWER_BOUND = frozenset({"at_least_max", "client_limited"})

NOT_POSITIVE = "capacity is not a positive number"
NO_DOCUMENT = "no capacity document"
NO_BRACKET = (
    "no bracket: the searches stored no interval around their capacities, "
    "so the ratio's interval has no width and a verdict would be false precision"
)


class CapacityRepeat(BaseModel):
    """One repeat of one variant: run status, ``runs.capacity`` (or None), devices reserved,
    ``untrusted``: why a flag of the run taints its capacity (None: it does not)."""

    run_id: str
    status: str = "succeeded"
    capacity: dict[str, Any] | None = None
    devices: int = Field(1, ge=1)
    untrusted: str | None = None


class SideCapacity(BaseModel):
    """One side's capacity: the envelope of its repeats' evidence (module docstring).

    ``capacity`` / ``per_device``: the mean, only when every succeeded repeat found one.
    ``low`` / ``high`` (``per_device_low`` / ``per_device_high``): the envelope, an end
    None where some repeat has no bound on that side. ``missing``: the succeeded repeats
    that show nothing, counted by why. ``bound``: ``found`` (every repeat found a
    capacity), ``bracket``, ``lower``, ``upper`` or ``none``. ``client_ceiling``: the
    lowest load-generator ceiling a repeat reports. ``untrusted``: run id -> why."""

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
    bound: Literal["found", "bracket", "lower", "upper", "none"] = "none"
    client_ceiling: float | None = None
    untrusted: dict[str, str] = Field(default_factory=dict)
    binding_slo: str | None = None
    notes: list[str] = Field(default_factory=list)


class CapacityComparison(BaseModel):
    """A variant's capacity against its reference's (see the module docstring).

    ``capacity`` / ``reference_capacity``: mean capacity of the repeats (only when
    every repeat of the side found one), in the variable's unit (``unit``).
    ``ratio``: of the means; ``[ci_low, ci_high]``: the interval over the sides'
    envelopes, an end None where a side is a bound (one-sided verdict).
    ``per_device_*``: the same per reserved device. ``statement`` /
    ``per_device_statement``: the verdict with its number (``higher: at least 2.86x``).
    Per side (``{"reference": ..., "variant": ...}``): ``interval`` (the envelope),
    ``bound`` (found / bracket / lower / upper / none), ``bounds`` (what it showed, in
    words), ``binding_slo``, ``found``, ``devices``, ``client_ceiling``. ``reason``: why
    the verdict is ``unknown``; ``untrusted_reason``: why it is ``untrusted``
    (``trustworthy`` False); ``notes``: caveats.
    """

    variable: str | None = None
    unit: str | None = None
    capacity: float | None = None
    reference_capacity: float | None = None
    ratio: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    verdict: CapacityVerdict = "unknown"
    statement: str | None = None
    capacity_per_device: float | None = None
    reference_capacity_per_device: float | None = None
    per_device_ratio: float | None = None
    per_device_ci_low: float | None = None
    per_device_ci_high: float | None = None
    per_device_verdict: CapacityVerdict = "unknown"
    per_device_statement: str | None = None
    interval: dict[str, list[float | None]] = Field(default_factory=dict)
    bound: dict[str, str] = Field(default_factory=dict)
    bounds: dict[str, str] = Field(default_factory=dict)
    binding_slo: dict[str, str | None] = Field(default_factory=dict)
    found: dict[str, int] = Field(default_factory=dict)
    devices: dict[str, int | None] = Field(default_factory=dict)
    client_ceiling: dict[str, float | None] = Field(default_factory=dict)
    reason: str | None = None
    trustworthy: bool = True
    untrusted_reason: str | None = None
    notes: list[str] = Field(default_factory=list)


def _positive(x: Any) -> float | None:
    """A finite positive float, else None."""
    f = finite_number(x)
    return f if f is not None and f > 0 else None


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _interval(doc: Mapping[str, Any]) -> tuple[float | None, float | None]:
    iv = doc.get("interval")
    if not isinstance(iv, list | tuple) or len(iv) != 2:
        return None, None
    return _positive(iv[0]), _positive(iv[1])


def _bound_text(status: str, doc: Mapping[str, Any]) -> str:
    """A search status with the bound or bracket it measured, if any (``below_min (below
    0.5)``, ``at_least_max (at least 16)``, ``uncertain (between 4 and 8)``)."""
    lo, hi = _interval(doc)
    if status == "below_min" and hi is not None:
        return f"{status} (below {hi:g})"
    if status in LOWER_BOUND and lo is not None:
        return f"{status} (at least {lo:g})"
    if status in ("uncertain", "steps_exhausted") and lo is not None and hi is not None:
        return f"{status} (between {lo:g} and {hi:g})"
    return status


def _variable(doc: Mapping[str, Any] | None) -> str | None:
    v = (doc or {}).get("variable")
    return v if isinstance(v, str) and v else None


@dataclass
class Evidence:
    """What one repeat shows: the capacity lies in ``[lo, hi]`` (None: no bound on that
    side); ``capacity`` only when it found one; ``notes`` on how its ends were read."""

    lo: float | None
    hi: float | None
    capacity: float | None = None
    notes: tuple[str, ...] = ()


def repeat_evidence(doc: Mapping[str, Any] | None) -> Evidence | str:
    """What a succeeded repeat's document shows (:class:`Evidence`), or why it shows
    nothing (a string)."""
    if not doc:
        return NO_DOCUMENT
    status = doc.get("status")
    if not isinstance(status, str) or not status:
        return "no search status"
    lo, hi = _interval(doc)
    if status == "found":
        cap = _positive(doc.get("capacity"))
        if cap is None:
            return NOT_POSITIVE
        notes = []
        if hi is None or hi < cap:
            notes.append(
                f"found {cap:g} with no failing load above it: counted as at least {cap:g}"
            )
        return Evidence(
            lo if lo is not None and lo <= cap else cap,
            hi if hi is not None and hi >= cap else None,
            cap,
            tuple(notes),
        )
    if status in LOWER_BOUND:
        return Evidence(lo, None) if lo is not None else _bound_text(status, doc)
    if status == "below_min":
        return Evidence(None, hi) if hi is not None else _bound_text(status, doc)
    if status in ("uncertain", "steps_exhausted") and (lo is not None or hi is not None):
        return Evidence(lo, hi)
    return _bound_text(status, doc)


def _envelope(
    pairs: Sequence[tuple[float | None, float | None]],
) -> tuple[float | None, float | None]:
    """``(min lo, max hi)``; an end None when any repeat has none on that side."""
    lows = [lo for lo, _ in pairs if lo is not None]
    highs = [hi for _, hi in pairs if hi is not None]
    low = min(lows) if pairs and len(lows) == len(pairs) else None
    high = max(highs) if pairs and len(highs) == len(pairs) else None
    return low, high


def _ceiling_note(label: str, r: CapacityRepeat, lo: float | None, unit: str) -> str:
    ceiling = _positive((r.capacity or {}).get("client_ceiling"))
    text = f"{label}: run {r.run_id} is client-limited: at least {lo:g} {unit}"
    if ceiling is not None:
        text += f"; the load generator's ceiling here is {ceiling:g} {unit}"
    else:
        text += "; the load generator's ceiling here was not measured"
    return text + " (scale the load generator out to measure beyond it)"


def side_capacity(repeats: Sequence[CapacityRepeat], label: str = "side") -> SideCapacity:
    """One side's capacity: envelope of its repeats' evidence, mean and per device.

    ``label`` names the side in notes (``"reference"`` / ``"variant"``). Bounds only
    when no succeeded repeat shows nothing (``missing`` is empty and ``searched`` > 0);
    the mean only when every one found a capacity.
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
        untrusted={r.run_id: r.untrusted for r in succeeded if r.untrusted},
    )
    unit = UNITS.get(out.variable or "", UNKNOWN_UNIT)
    if out.mixed_variables:
        names = sorted(v or "none" for v in variables)
        out.notes.append(f"{label}: repeats searched different variables ({names})")
    if not searched:
        return out
    usable: list[tuple[CapacityRepeat, Evidence]] = []
    missing: Counter[str] = Counter()
    missing_runs: dict[str, list[str]] = {}
    for r in succeeded:
        ev = repeat_evidence(r.capacity)
        if isinstance(ev, str):
            missing[ev] += 1
            missing_runs.setdefault(ev, []).append(r.run_id)
        else:
            usable.append((r, ev))
    found = [(r, ev) for r, ev in usable if ev.capacity is not None]
    out.found = len(found)
    out.missing = dict(missing)
    named = [u for u, _ in found] or searched
    bindings = Counter(str(b) for b in ((r.capacity or {}).get("binding_slo") for r in named) if b)
    if bindings:
        out.binding_slo = bindings.most_common(1)[0][0]
        if len(bindings) > 1:
            each = ", ".join(f"{b} x{n}" for b, n in bindings.most_common())
            out.notes.append(f"{label}: the binding SLO differs between repeats ({each})")
    ceilings = [_positive((r.capacity or {}).get("client_ceiling")) for r, _ in usable]
    out.client_ceiling = min((c for c in ceilings if c is not None), default=None)
    if missing:
        runs = "; ".join(f"{p}: {', '.join(ids)}" for p, ids in missing_runs.items())
        out.notes.append(f"{label}: repeats without a capacity or a bound ({runs})")
        if found:
            caps = ", ".join(f"{ev.capacity:.4g}" for _, ev in found)
            out.notes.append(
                f"{label}: {len(found)} of {len(succeeded)} repeats found a capacity "
                f"({caps}); a side shows something only when every repeat does"
            )
        return out
    _combine(out, usable, found, label, unit)
    return out


def _combine(
    out: SideCapacity,
    usable: Sequence[tuple[CapacityRepeat, Evidence]],
    found: Sequence[tuple[CapacityRepeat, Evidence]],
    label: str,
    unit: str,
) -> None:
    """Fill ``out`` from repeats that all show something: the envelope of their bounds
    (per device too), the mean capacity when every one found one, and what kind of bound
    the side shows."""
    for r, ev in usable:
        out.notes += [f"{label}: run {r.run_id}: {n}" for n in ev.notes]
        if (r.capacity or {}).get("status") == "client_limited":
            out.notes.append(_ceiling_note(label, r, ev.lo, unit))
    out.low, out.high = _envelope([(ev.lo, ev.hi) for _, ev in usable])
    out.per_device_low, out.per_device_high = _envelope(
        [(_per(ev.lo, r.devices), _per(ev.hi, r.devices)) for r, ev in usable]
    )
    devices = {r.devices for r, _ in usable}
    out.devices = next(iter(devices)) if len(devices) == 1 else None
    if len(found) == len(usable):
        caps_f = [ev.capacity for _, ev in found if ev.capacity is not None]
        out.capacity = _mean(caps_f)
        out.per_device = _mean([(ev.capacity or 0.0) / r.devices for r, ev in found])
        if len(caps_f) > 1 and max(caps_f) > min(caps_f):
            out.notes.append(
                f"{label}: repeats' capacities spread {min(caps_f):.4g}..{max(caps_f):.4g}; "
                f"the interval is the envelope of their brackets {_pair(out.low, out.high)}"
            )
    out.bound = (
        "found"
        if out.capacity is not None and out.low is not None and out.high is not None
        else "bracket"
        if out.low is not None and out.high is not None
        else "lower"
        if out.low is not None
        else "upper"
        if out.high is not None
        else "none"
    )


def _per(x: float | None, devices: int) -> float | None:
    return None if x is None else x / devices


def _pair(lo: float | None, hi: float | None) -> str:
    return f"[{'–' if lo is None else f'{lo:.4g}'}, {'–' if hi is None else f'{hi:.4g}'}]"


def side_text(side: SideCapacity) -> str:
    """What a side showed, in words: ``found 8 [7.5, 8.4]``, ``at least 24``, ``below 1``,
    ``between 6 and 9``; ``unknown`` when nothing."""
    lo, hi = side.low, side.high
    if side.capacity is not None:
        return f"found {side.capacity:.4g} " + _pair(lo, hi)
    if lo is not None and hi is not None:
        return f"between {lo:.4g} and {hi:.4g}"
    if lo is not None:
        return f"at least {lo:.4g}"
    if hi is not None:
        return f"below {hi:.4g}"
    return "unknown"


def _unknown_reason(label: str, side: SideCapacity) -> str:
    if not side.searched:
        return f"{label}: no succeeded run with a capacity search"
    if not side.missing:
        each = ", ".join(f"{s} x{n}" for s, n in sorted(side.statuses.items()))
        return f"{label}: its repeats' bounds disagree ({each}): no bound holds for all of them"
    texts = Counter(side.missing)
    each = ", ".join(f"{t} x{n}" if len(texts) > 1 else t for t, n in texts.most_common())
    shown = side.succeeded - sum(texts.values())
    if not shown:
        return f"{label}: {each}"
    return (
        f"{label}: {sum(texts.values())} of {side.succeeded} repeats show neither a capacity "
        f"nor a bound: {each}"
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    r = a / b
    return r if math.isfinite(r) else None


def _no_width(lo: float | None, hi: float | None) -> bool:
    """An interval that is a point (or inverted): no bracket around the ratio."""
    return lo is not None and hi is not None and hi - lo <= 1e-12 * max(1.0, abs(hi))


def _x(v: float) -> str:
    if v >= 10:
        return f"{v:.3g}x"
    text = f"{v:.2f}"
    if text == "1.00" and v != 1.0:  # a bound just off 1 must not read as 1 itself
        text = f"{v:.4f}"
    return f"{text}x"


def decide(
    ratio: float | None, lo: float | None, hi: float | None
) -> tuple[CapacityVerdict, str | None, str | None]:
    """(verdict, statement, reason when unknown) of a ratio interval ``[lo, hi]`` (an end
    None: unbounded on that side; ``ratio``: the point estimate, only when both sides
    found a capacity; module docstring)."""
    if lo is not None and hi is not None:
        if _no_width(lo, hi):
            return "unknown", None, NO_BRACKET
        verdict: CapacityVerdict = "higher" if lo > 1 else "lower" if hi < 1 else "no_change"
        if ratio is None and verdict == "no_change":  # a search that did not finish
            return "unknown", None, f"the ratio is {_x(lo)} to {_x(hi)}, which does not exclude 1"
        point = f"{_x(ratio)} " if ratio is not None else ""
        span = f"[{lo:.2f}, {hi:.2f}]" if ratio is not None else f"{_x(lo)} to {_x(hi)}"
        return verdict, f"{verdict.replace('_', ' ')}: {point}{span}", None
    if lo is not None:
        if lo > 1:
            return "higher", f"higher: at least {_x(lo)}", None
        return "unknown", None, f"the ratio is at least {_x(lo)}, which does not exclude 1"
    if hi is not None:
        if hi < 1:
            return "lower", f"lower: at most {_x(hi)}", None
        return "unknown", None, f"the ratio is at most {_x(hi)}, which does not exclude 1"
    return "unknown", None, "neither side bounds the ratio"


def compare_capacity(
    variant: Sequence[CapacityRepeat], reference: Sequence[CapacityRepeat]
) -> CapacityComparison:
    """The variant's capacity against its reference's: ratio, interval, verdict (one-sided
    when a side is a bound; the module docstring has the rules)."""
    v = side_capacity(variant, "variant")
    r = side_capacity(reference, "reference")
    out = CapacityComparison(
        variable=v.variable or r.variable,
        capacity=v.capacity,
        reference_capacity=r.capacity,
        capacity_per_device=v.per_device,
        reference_capacity_per_device=r.per_device,
        interval={"reference": [r.low, r.high], "variant": [v.low, v.high]},
        bound={"reference": r.bound, "variant": v.bound},
        bounds={"reference": side_text(r), "variant": side_text(v)},
        binding_slo={"reference": r.binding_slo, "variant": v.binding_slo},
        found={"reference": r.found, "variant": v.found},
        devices={"reference": r.devices, "variant": v.devices},
        client_ceiling={"reference": r.client_ceiling, "variant": v.client_ceiling},
        notes=r.notes + v.notes,
    )
    out.unit = UNITS.get(out.variable or "", UNKNOWN_UNIT)
    reasons = []
    if r.bound == "none":
        reasons.append(_unknown_reason("reference", r))
    if v.bound == "none":
        reasons.append(_unknown_reason("variant", v))
    if not reasons and (v.variable != r.variable or v.mixed_variables or r.mixed_variables):
        reasons.append(
            f"the sides searched different variables ({r.variable or 'unknown'} vs "
            f"{v.variable or 'unknown'}); their capacities do not compare"
        )
    if reasons:
        out.reason = "; ".join(reasons)
        return out
    flagged = [
        f"{label} run {rid}: {why}"
        for label, side in (("variant", v), ("reference", r))
        for rid, why in side.untrusted.items()
    ]
    if flagged:
        out.verdict = out.per_device_verdict = "untrusted"
        out.trustworthy = False
        out.untrusted_reason = "; ".join(flagged)
        return out
    out.ratio = _ratio(v.capacity, r.capacity)
    out.per_device_ratio = _ratio(v.per_device, r.per_device)
    ci = (_ratio(v.low, r.high), _ratio(v.high, r.low))
    out.verdict, out.statement, why = decide(out.ratio, *ci)
    if out.verdict == "unknown":
        sides = f"variant {out.bounds['variant']} vs reference {out.bounds['reference']}"
        out.reason = why if why == NO_BRACKET else f"{why} ({sides} {out.unit})"
    else:
        out.ci_low, out.ci_high = ci
    pd = (_ratio(v.per_device_low, r.per_device_high), _ratio(v.per_device_high, r.per_device_low))
    out.per_device_verdict, out.per_device_statement, _ = decide(out.per_device_ratio, *pd)
    if out.per_device_verdict != "unknown":
        out.per_device_ci_low, out.per_device_ci_high = pd
    if out.verdict != "unknown" and min(v.found, r.found) < 2 and v.bound == r.bound == "found":
        out.notes.append(
            "one found repeat on a side: the interval is the searches' bracket only "
            "(their tolerance), not run-to-run drift"
        )
    return out


def capacity_regression(comp: CapacityComparison, min_change: float = MIN_CHANGE) -> bool:
    """A capacity drop: the verdict is ``lower`` (the ratio's whole interval, or its
    upper bound, below 1) and the drop passes the regression floor (the ratio, or its
    upper bound when a side is only a bound, at or below ``1 / (1 + min_change)``:
    :func:`orchestrator.analysis.regression.capacity_is_regression`); never from
    ``unknown`` or ``untrusted``."""
    return capacity_is_regression(comp.verdict, comp.ratio, comp.ci_high, min_change)
