"""Steady-state load steps: what a capacity step's records say (how long it lasts:
:mod:`jobs.capacity.stepplan`).

:mod:`jobs.capacity.search` decides a step from its objectives; this module says whether the
step measured a **steady state** at the load that was asked for, and if not, whose
limit it hit: the server's or the load generator's. Pure: no I/O, no clock.

**Steadiness** (:func:`analyze`). The measured part runs from the first measured
arrival ``t_w`` to the last one ``t_e`` (closed loop: dispatches). Open loop: ``Q(t)``,
the requests asked for by ``t`` (their ``scheduled_s``) minus those completed by ``t``
(``start_s + e2el_s``; a failed request without an E2EL completes at its start), counts
every request that is due and not done: waiting for a slot in the client, in flight, or
queued in the server. Below the capacity ``Q`` fluctuates around a level; above it
``Q`` grows by ``(1 - mu / L)`` of the arrivals. With ``G = Q(t_e) - Q(t_w)`` (the
growth over the measured part), ``A`` its arrivals, ``z`` the normal quantile of the
search's two-sided ``confidence``, ``var`` the variance of ``Q`` over the part (a trend
included) and ``var_d`` around its least-squares line:

- ``stationary = True`` when ``G + z * sqrt(2 var + 1) <= GROWTH_FRACTION * A``
  (:data:`GROWTH_FRACTION` 8 %): the queue grew by less than that share of the
  arrivals, by more than its own fluctuations (two endpoints, each with the queue's
  variance; +1 for counting whole requests). A growing queue's trend enters ``var``
  (``G^2 / 12`` for a straight line), so an overload cannot pass: the pass needs
  ``G <= 4.4 %`` of the arrivals even without noise, i.e. a load at most ~1.05 times
  the capacity. Endpoints, not a fitted slope: with the arrival count of the part
  fixed by :func:`scale_schedule`, the endpoints of an overloaded queue differ by the
  completions' regular shortfall, while a slope would carry the arrivals' clumping;
- ``stationary = False`` (the queue grows) when ``G - z * sqrt(2 var_d + 1) >
  FAIL_FRACTION * A`` (:data:`FAIL_FRACTION` 3 %);
- the fail margin uses at least the queue's mean level over the part's first quarter
  as ``var_d``: requests in flight fluctuate at least like a Poisson count (M/G/inf),
  and a short part's variance around its trend misses the slow swings of long,
  variable service times (a trial found exponential service at half the capacity
  failed as "growing", with the server's waiting queue at 0);
- ``None`` (too short or too noisy to tell) otherwise, and whenever the measured part
  has fewer than :data:`MIN_MEASURED_ARRIVALS` arrivals or lasts less than
  :data:`MIN_WINDOW_REQUEST_TIMES` unloaded request times. A step is ``pass`` only when
  ``True``. Re-measurements at one load pool ``G``, ``A`` and the variances.

Near the capacity the queue's fluctuations are large, so a verdict there needs a few
hundred measured arrivals (fewer for servers with many slots): shorter steps say
``None`` rather than guess. ``tests/jobs/test_capacity_steady.py`` checks over many
simulated queues that no step passes above ~1.05 times the capacity.

Closed loop: the population is the concurrency, so nothing can grow; the measured part
must still last :data:`MIN_WINDOW_REQUEST_TIMES` request times with
:data:`MIN_CLOSED_LOOP_REQUESTS` dispatches (else ``None``). A concurrency step lasts
at least long enough for ``floor`` requests at ``load / unloaded_s`` per second.

**Asked and arrived load** (open loop): ``asked_rate`` is the measured part's scheduled
arrivals per second (``(A - 1) / (t_e - t_w)``), ``arrived_rate`` the requests that
really went out (``start_s``) in the same window per second, ``completed_rate`` those
that completed in it. A request's lateness ``start_s - scheduled_s`` is split by the
share of its wait during which the server blocked sending: the in-flight cap (the
workload's ``concurrency``) full, or the next request in list order waiting for its
conversation's previous turn to finish (dispatch is in list order). That share is
**slot wait** (server evidence), the rest **client lag** (nothing but the load
generator kept the request back).

**Client limits** (the step is ``client_limited``: neither pass nor fail), any of:
the arrived count falls short of the asked one by more than :data:`ARRIVAL_SHORTFALL`
(and 2 requests) with more client lag than slot wait; client lag p90 over
``max(``:data:`CLIENT_LAG_FLOOR_MS` ``, 2 mean gaps)``; the load generator's CPU at
:data:`CLIENT_CPU_BUSY` of a core per process or more (``client_cpu / client_workers``);
the step's load above a known ``client_ceiling`` (req/s); the load generator's own
stalls (:func:`jobs.load.stalls.step_stall_limit`: its event loop could not run long
enough to move 1 % of the measured requests by a tenth, or for 5 % of the measured part;
watched when the load runs on the runner's event loop).

**Server evidence** (listed in the step's ``saturation_evidence``): failed requests
over 5 % (errors, timeouts, requests cut by the drain limit), the server's waiting queue
growing through the step, the queue ``Q`` growing with the load generator keeping up,
slot wait (the in-flight cap full), the KV cache at :data:`KV_FULL` or more,
preemptions. :mod:`jobs.capacity.search` says which of them fail a step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # jobs.capacity.search imports this module
    from jobs.schemas import RequestRecord

from jobs.capacity.stepplan import (  # re-exported: capacity_spec imports them from here
    DRAIN_REQUEST_TIMES,
    MAX_LIST_REQUESTS,
    StepPlan,
    unloaded_time,
)
from jobs.load.stalls import step_stall_limit

__all__ = [
    "Growth",
    "DRAIN_REQUEST_TIMES",
    "MAX_LIST_REQUESTS",
    "StepDynamics",
    "analyze",
    "client_fell_behind",
    "in_flight_cap_limit",
    "growth_verdict",
    "is_step_warmup",
    "measured_wall",
]

GROWTH_FRACTION = 0.08
"""Queue growth over the measured part, as a fraction of its arrivals, that is overload."""

FAIL_FRACTION = 0.03
"""Queue growth, as a fraction of the arrivals, beyond which (and its margin) it grows."""

GRID_POINTS = 256
"""Instants of the measured part at which the queue is counted."""

MIN_MEASURED_ARRIVALS = 50
"""Fewer measured arrivals (or closed-loop dispatches) than this: too short to tell."""

MIN_CLOSED_LOOP_REQUESTS = 20
"""Fewer closed-loop dispatches in the measured part than this: too short to tell."""

MIN_WINDOW_REQUEST_TIMES = 3.0
"""A measured part shorter than this many unloaded request times: too short to tell."""

CLIENT_LAG_FLOOR_MS = 50.0
"""Client lag p90 under this is never a client limit (timer jitter)."""

ARRIVAL_SHORTFALL = 0.05
"""Arrived requests under the asked ones by more than this fraction: a shortfall."""

CLIENT_CPU_BUSY = 0.9
"""Load-generator CPU per process (cores) from which the client is the bottleneck."""

KV_FULL = 0.98
"""KV cache usage (0-1) from which the cache counts as full."""


@dataclass
class Growth:
    """Queue growth over one measured part: ``growth`` (requests, ``Q(t_e) - Q(t_w)``),
    the variance of ``Q`` over the part (``var``, trend included) and around its linear
    trend (``var_detrended``), and the measured ``arrivals``."""

    growth: float
    var: float
    var_detrended: float
    arrivals: int
    level_start: float = 0.0  # mean of Q over its first quarter: the floor of the fail margin


def growth_verdict(
    parts: Sequence[Growth], confidence: float
) -> tuple[bool | None, float, float, int]:
    """Pool ``parts`` (re-measurements at one load): ``(stationary, growth, margin,
    arrivals)`` with the rule of the module docstring (True / False / None); ``margin``
    is the pass rule's ``z * sqrt(sum(2 var + 1))``."""
    growth = sum(p.growth for p in parts)
    arrivals = sum(p.arrivals for p in parts)
    z = NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2.0)
    # a count of requests in flight fluctuates at least like a Poisson count (variance =
    # mean: M/G/inf); a short part's own variance around its trend can miss slow swings
    # (long, variable service times), so the fail margin does not go under that floor
    margin = z * math.sqrt(sum(2.0 * p.var + 1.0 for p in parts))
    margin_fail = z * math.sqrt(sum(2.0 * max(p.var_detrended, p.level_start) + 1.0 for p in parts))
    limit = GROWTH_FRACTION * arrivals
    if growth + margin <= limit:
        return True, growth, margin, arrivals
    if growth - margin_fail > FAIL_FRACTION * arrivals:
        return False, growth, margin, arrivals
    return None, growth, margin, arrivals


@dataclass
class StepDynamics:
    """What a step's records say about its steadiness and whose limit it hit."""

    measured: list[RequestRecord] = field(default_factory=list)
    warmup_requests: int = 0
    measured_s: float | None = None
    asked_rate: float | None = None
    arrived_rate: float | None = None
    completed_rate: float | None = None
    client_lag_p90_ms: float | None = None
    slot_wait_p90_ms: float | None = None
    growth: Growth | None = None
    too_short: str | None = None  # why steadiness cannot be told at all
    client_limits: list[str] = field(default_factory=list)
    queue_text: str | None = None  # the queue's course over the measured part, in words
    slot_wait_text: str | None = None  # the in-flight cap was full (server evidence)
    in_flight_growth: float | None = None  # sent and not done, over the measured part
    backlog_growth: float | None = None  # due and not sent, over the measured part
    measured_wall_s: float | None = None  # first measured start to last measured end
    client_lag_s: float = 0.0  # summed over the measured requests
    slot_wait_s: float = 0.0


CAP_SLOWDOWN = 2.0
"""Median E2EL over this many unloaded request times: the server slowed (its own limit)."""


def in_flight_cap_limit(dyn: StepDynamics, plan: StepPlan, unloaded_s: float | None) -> str | None:
    """The workload's in-flight cap, not the server, held an open-loop step back, in words
    (None: it did not, or it cannot be told): the cap was full (slot wait), the requests
    due and not sent grew more than those in flight, and the requests that did go out
    took about their unloaded time (median E2EL at most :data:`CAP_SLOWDOWN` unloaded
    request times): a server at its limit slows them down, a cap smaller than what the
    server can hold does not."""
    if plan.variable != "request_rate" or dyn.slot_wait_text is None or not unloaded_s:
        return None
    backlog, in_flight = dyn.backlog_growth, dyn.in_flight_growth
    if backlog is None or in_flight is None or backlog <= max(in_flight, 1.0):
        return None
    e2el = [r.e2el_s for r in dyn.measured if r.success and r.e2el_s is not None]
    if not e2el:
        return None
    median = float(np.median(e2el))
    if median > CAP_SLOWDOWN * unloaded_s:
        return None
    return (
        f"the in-flight cap ({plan.in_flight}, the workload's concurrency) was full while "
        f"requests took about their unloaded time (median E2EL {median * 1000:.0f} ms, "
        f"unloaded {unloaded_s * 1000:.0f} ms): the cap held the load back, not the server; "
        "raise the workload's concurrency"
    )


def client_fell_behind(dyn: StepDynamics) -> str | None:
    """When the queue grew: the load generator's share of it, in words, if it is the
    larger one (requests due and not sent grew more than those in flight, and their wait
    was more client lag than slot wait); None: the server's."""
    backlog, in_flight = dyn.backlog_growth, dyn.in_flight_growth
    if backlog is None or in_flight is None or backlog <= max(in_flight, 0.0):
        return None
    if dyn.client_lag_s <= dyn.slot_wait_s:
        return None
    return (
        f"the load generator fell behind: requests due and not sent grew by {backlog:g} "
        f"while those in flight grew by {in_flight:g}"
    )


def measured_wall(records: Sequence[RequestRecord]) -> float | None:
    """Seconds from the first start to the last end of ``records`` (None: fewer than one
    request, or no time)."""
    if not records:
        return None
    wall = max(_end(r) for r in records) - min(r.start_s for r in records)
    return wall if wall > 0 else None


def is_step_warmup(record: RequestRecord, plan: StepPlan, t0: float) -> bool:
    """Whether ``record`` belongs to the step's warm-up part (``t0``: the step's first
    arrival, or first dispatch in a closed loop)."""
    if plan.variable == "request_rate" and record.scheduled_s is not None:
        return record.scheduled_s - t0 < plan.warmup_s - 1e-9
    return record.start_s - t0 < plan.warmup_s - 1e-9


def step_origin(records: Sequence[RequestRecord], plan: StepPlan) -> float | None:
    """The step's first arrival (open loop: smallest ``scheduled_s``) or first dispatch."""
    load = [r for r in records if not r.warmup]
    if plan.variable == "request_rate":
        due = [r.scheduled_s for r in load if r.scheduled_s is not None]
        if due:
            return min(due)
    return min((r.start_s for r in load), default=None)


def _end(r: RequestRecord) -> float:
    if r.e2el_s is not None and math.isfinite(r.e2el_s) and r.e2el_s >= 0:
        return r.start_s + r.e2el_s
    return r.start_s


def _count_at(sorted_times: np.ndarray, t: np.ndarray) -> np.ndarray:
    """How many of ``sorted_times`` are at or before each ``t``."""
    return np.searchsorted(sorted_times, t, side="right")


def _growth(due: np.ndarray, ends: np.ndarray, t_w: float, t_e: float, arrivals: int) -> Growth:
    """Queue growth over ``[t_w, t_e]`` (``Q(t_e) - Q(t_w)``) and its two margins: the
    queue's variance over the part (trend included) and around its linear trend."""
    grid = np.linspace(t_w, t_e, GRID_POINTS)
    q = (_count_at(due, grid) - _count_at(ends, grid)).astype(float)
    x = grid - grid.mean()
    slope = float(np.dot(x, q - q.mean()) / np.dot(x, x))
    resid = q - q.mean() - slope * x
    return Growth(
        growth=float(q[-1] - q[0]),
        var=float(q.var()),
        var_detrended=float(resid.var()),
        arrivals=arrivals,
        level_start=float(q[: max(1, GRID_POINTS // 4)].mean()),
    )


def _server_blocked(
    load: Sequence[RequestRecord], starts: np.ndarray, ends: np.ndarray, cap: int
) -> list[tuple[float, float]]:
    """The intervals during which the client could not send for the server's sake: at
    least ``cap`` requests in flight, or the next request in list order waiting for its
    conversation's previous turn to finish (dispatch is in list order, so the requests
    behind it wait too). Disjoint and sorted."""
    spans: list[tuple[float, float]] = []
    events = np.unique(np.concatenate([starts, ends]))
    if events.size:
        in_flight = _count_at(starts, events) - _count_at(ends, events)
        for k in np.flatnonzero(in_flight[:-1] >= cap):
            spans.append((float(events[k]), float(events[k + 1])))
    done = {
        (r.conversation, r.turn): _end(r)
        for r in load
        if r.conversation is not None and r.turn is not None
    }
    ordered = sorted(load, key=lambda r: r.start_s)
    for before, r in zip([None, *ordered[:-1]], ordered, strict=True):
        if r.conversation is None or r.turn is None or r.scheduled_s is None:
            continue
        previous = done.get((r.conversation, r.turn - 1))
        head = max(r.scheduled_s, before.start_s if before is not None else r.scheduled_s)
        if previous is not None and previous > head:
            spans.append((head, min(previous, r.start_s)))
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        elif b > a:
            merged.append((a, b))
    return merged


def _blocked_share(spans: list[tuple[float, float]], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """For each interval ``[a, b]``: the share of it covered by ``spans``."""
    if not spans:
        return np.zeros_like(a)
    lo = np.array([x for x, _ in spans])
    hi = np.array([y for _, y in spans])
    cum = np.concatenate([[0.0], np.cumsum(hi - lo)])

    def covered_until(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(lo, t, side="right")  # spans starting at or before t
        last = np.maximum(k - 1, 0)
        inside = np.maximum(0.0, np.minimum(t, hi[last]) - lo[last])
        return np.where(k > 0, cum[last] + inside, 0.0)

    span = b - a
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(span > 0, (covered_until(b) - covered_until(a)) / span, 0.0)
    return np.clip(share, 0.0, 1.0)


def analyze(
    records: Sequence[RequestRecord],
    plan: StepPlan,
    *,
    client_cpu: float | None = None,
    client_workers: int | None = None,
    client_ceiling: float | None = None,
    stalls: Sequence[tuple[float, float]] | None = None,
) -> StepDynamics:
    """The step's steadiness signals and client limits (rules in the module docstring).

    ``records``: the step's records (earlier warm-ups, ``warmup=True``, are ignored);
    ``client_cpu``: load-generator CPU seconds per wall second over the step, summed
    over its ``client_workers`` processes; ``stalls``: the load generator's stalls
    (:class:`jobs.load.stalls.LoopWatch`, on the records' clock; None: not watched).
    """
    load = [r for r in records if not r.warmup]
    out = StepDynamics()
    t0 = step_origin(load, plan)
    if t0 is None:
        out.too_short = "no request was sent"
        return out
    warm = [r for r in load if is_step_warmup(r, plan, t0)]
    out.measured = [r for r in load if not is_step_warmup(r, plan, t0)]
    out.warmup_requests = len(warm)
    out.measured_wall_s = measured_wall(out.measured)
    open_loop = plan.variable == "request_rate" and any(
        r.scheduled_s is not None for r in out.measured
    )
    when = [
        (r.scheduled_s if open_loop and r.scheduled_s is not None else r.start_s)
        for r in out.measured
    ]
    out.client_limits += _client_limits(plan, client_cpu, client_workers, client_ceiling)
    if len(when) < 2:
        out.too_short = f"{len(when)} measured request(s)"
        return out
    t_w, t_e = min(when), max(when)
    if stalls is not None and (stalled := step_stall_limit(stalls, out.measured, (t_w, t_e))):
        out.client_limits.append(stalled)
    length = t_e - t_w
    out.measured_s = length
    if length <= 0:
        out.too_short = "the measured requests were all due at once"
        return out
    unloaded = plan.unloaded_s or unloaded_time(load, "min")
    starts = np.sort(np.array([r.start_s for r in load]))
    ends = np.sort(np.array([_end(r) for r in load]))
    out.completed_rate = int(np.sum((ends > t_w) & (ends <= t_e))) / length
    if not open_loop:
        out.arrived_rate = (len(when) - 1) / length
    else:
        _open_loop(out, load, plan, starts, ends, (t_w, t_e), len(when))
    least = MIN_MEASURED_ARRIVALS if open_loop else MIN_CLOSED_LOOP_REQUESTS
    if len(when) < least:
        out.too_short = f"{len(when)} measured requests, under {least}"
    elif unloaded is not None and length < MIN_WINDOW_REQUEST_TIMES * unloaded:
        out.too_short = (
            f"the measured part lasted {length:.3g} s, under {MIN_WINDOW_REQUEST_TIMES:g} "
            f"unloaded request times ({unloaded:.3g} s each)"
        )
    return out


def _client_limits(
    plan: StepPlan,
    client_cpu: float | None,
    client_workers: int | None,
    client_ceiling: float | None,
) -> list[str]:
    """What says the load generator, not the server, limited the step: a busy core per
    process, or a request rate above the client's calibrated ceiling."""
    limits: list[str] = []
    workers = client_workers or 1
    if client_cpu is not None and client_cpu / workers >= CLIENT_CPU_BUSY:
        limits.append(
            f"the load generator used {client_cpu / workers:.0%} of a core per process "
            f"({workers} process{'es' if workers > 1 else ''})"
        )
    if (
        client_ceiling is not None
        and plan.variable == "request_rate"
        and plan.load > client_ceiling
    ):
        limits.append(
            f"the load {plan.load:.4g} req/s is above the load generator's ceiling here "
            f"({client_ceiling:.4g} req/s)"
        )
    return limits


def _open_loop(
    out: StepDynamics,
    load: list[RequestRecord],
    plan: StepPlan,
    starts: np.ndarray,
    ends: np.ndarray,
    window: tuple[float, float],
    asked: int,
) -> None:
    """An open-loop step's rates, lags, queue growth and backlog over the measured
    ``window`` (``asked`` requests due in it) into ``out``."""
    t_w, t_e = window
    length = t_e - t_w
    due = np.sort(np.array([r.scheduled_s for r in load if r.scheduled_s is not None]))
    arrived = int(np.sum((starts >= t_w) & (starts <= t_e)))
    out.asked_rate = (asked - 1) / length
    out.arrived_rate = max(0, arrived - 1) / length
    _lags(out, _server_blocked(load, starts, ends, plan.in_flight), plan, asked, arrived)
    out.growth = _growth(due, ends, t_w, t_e, asked)
    at = np.array([t_w, t_e])
    q_first, q_last = (_count_at(due, at) - _count_at(ends, at)).tolist()
    i_first, i_last = (_count_at(starts, at) - _count_at(ends, at)).tolist()
    out.in_flight_growth = float(i_last - i_first)
    out.backlog_growth = float((q_last - q_first) - (i_last - i_first))
    out.queue_text = (
        f"requests due and not done went from {q_first} to {q_last} over the measured "
        f"{length:.3g} s (asked {out.asked_rate:.4g} req/s, completed "
        f"{out.completed_rate:.4g} req/s)"
    )


def _lags(
    out: StepDynamics,
    blocked: list[tuple[float, float]],
    plan: StepPlan,
    asked: int,
    arrived: int,
) -> None:
    """Client lag and slot wait of the open loop's measured requests (a request's
    lateness split by the share of it during which the server ``blocked`` sending);
    client limits."""
    timed = [r for r in out.measured if r.scheduled_s is not None]
    due = np.array([r.scheduled_s for r in timed], dtype=float)
    sent = np.array([r.start_s for r in timed], dtype=float)
    late = np.maximum(0.0, sent - due)
    share = _blocked_share(blocked, due, np.maximum(due, sent))
    slot_wait, client_lag = late * share, late * (1.0 - share)
    out.client_lag_s, out.slot_wait_s = float(client_lag.sum()), float(slot_wait.sum())
    if late.size:
        out.client_lag_p90_ms = float(np.percentile(client_lag, 90)) * 1000.0
        out.slot_wait_p90_ms = float(np.percentile(slot_wait, 90)) * 1000.0
    gap_ms = 1000.0 / plan.load
    threshold = max(CLIENT_LAG_FLOOR_MS, 2 * gap_ms)
    if out.client_lag_p90_ms is not None and out.client_lag_p90_ms > threshold:
        out.client_limits.append(
            f"client lag p90 {out.client_lag_p90_ms:.1f} ms with free in-flight slots "
            f"(over {threshold:.1f} ms)"
        )
    short = asked - arrived
    if short > max(2.0, ARRIVAL_SHORTFALL * asked) and out.client_lag_s > out.slot_wait_s:
        out.client_limits.append(
            f"{arrived} of {asked} asked requests went out during the measured part "
            "while in-flight slots were free"
        )
    if out.slot_wait_p90_ms is not None and out.slot_wait_p90_ms > threshold:
        out.slot_wait_text = (
            f"the in-flight cap ({plan.in_flight}) was full or a conversation's previous "
            f"turn unfinished: slot wait p90 {out.slot_wait_p90_ms:.1f} ms"
        )
