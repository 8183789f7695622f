"""One capacity step's verdict: pass, fail, uncertain or client_limited.

:class:`jobs.capacity.search.CapacitySearch` measures a step and calls :func:`decide` with the
step's measured values (:mod:`jobs.capacity.slochecks`), its dynamics
(:mod:`jobs.capacity.steadystate`) and its signals. The rules, in this order:

1. a step with no measured request is ``uncertain``;
2. **saturated** (``fail``; the reasons in ``saturated`` and, with the other server
   evidence seen, in ``saturation_evidence``): failed requests over
   :data:`SATURATION_FAILED_FRACTION` (5 %) of the step's measured part (errors,
   timeouts, and the requests still unfinished ``drain_s`` after the step's last
   arrival when the step is cut); for ``request_rate``, the server's waiting queue grew
   through the step (``waiting_last - waiting_first`` over ``max(1, 5 % of the
   measured requests)`` with ``waiting_max > 0``: below the capacity the queue at two
   instants differs by O(1) requests, above it it grows by ``(1 - mu / lambda) * N``
   over ``N`` arrivals; in a closed loop the queue is bounded by the concurrency, so it
   is no sign of overload there);
3. **client_limited** (neither pass nor fail; why in ``client_limit``): the load
   generator could not deliver the step (:mod:`jobs.capacity.steadystate`: arrivals short of the
   asked ones while in-flight slots were free, client lag with free slots, its CPU near
   a full core per process, or a load above ``client_ceiling``). The latencies and the
   queue of such a step say nothing about the server, its failed objectives included;
4. **queue growing** (``fail``, saturated with that evidence): open loop, the requests
   due and not done grew by more than 5 % of the measured arrivals (``stationary``
   False) while the load generator kept up; the in-flight cap being full (slot wait),
   the KV cache full and preemptions are shown beside it;
5. an objective fails (its interval's lower end over it): ``fail``;
6. ``stationary`` is not True (too short or too noisy to tell) or an objective's
   interval straddles it: ``uncertain``; otherwise ``pass``.

Client dispatch lag is never saturation: lag with free in-flight slots is the load
generator's limit (3.); lag because the server held every slot is server evidence shown
with the growing queue (4.).

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, Field

from jobs.capacity.slochecks import (
    METRICS,
    REPORTED_PERCENTILES,
    SLOCheck,
    StepValues,
    check_goodput,
    check_percentile,
    good_mask,
    percentile_of,
)
from jobs.capacity.steadystate import (
    GROWTH_FRACTION,
    KV_FULL,
    Growth,
    StepDynamics,
    client_fell_behind,
    growth_verdict,
)
from jobs.capacity.stepplan import StepPlan

if TYPE_CHECKING:  # jobs.capacity.search imports this module
    from jobs.capacity.search import CapacitySpec

__all__ = ["CapacityStep", "StepSignals", "decide"]

Verdict = Literal["pass", "fail", "uncertain", "client_limited"]

SATURATION_FAILED_FRACTION = 0.05
"""A step with more failed requests than this fraction is saturated."""

SATURATION_WAITING_FRACTION = 0.05
"""Server waiting-queue growth through a step, as a fraction of its requests: overload."""


class StepSignals(BaseModel):
    """Server and client signals of one step (``None``: not observed).

    Server (``/metrics``): ``waiting_first`` / ``waiting_last``: ``num_requests_waiting``
    at the step's first and last dispatch; ``waiting_max`` the most seen in between;
    ``kv_cache_usage_max`` (0-1); ``preemptions`` over the step.
    Client, over the measured part (:mod:`jobs.capacity.steadystate`): ``asked_rate`` (req/s the
    schedule asked for), ``arrived_rate`` (req/s that went out), ``completed_rate``;
    ``dispatch_lag_p99_ms`` (open loop, ``start_s - scheduled_s``), split into
    ``client_lag_p90_ms`` (with a free in-flight slot) and ``slot_wait_p90_ms`` (the
    in-flight cap full); ``queue_growth``: growth of the requests due and not done
    (requests); ``client_cpu``: load-generator CPU seconds per wall second over the
    step, summed over its ``client_workers`` processes.
    """

    waiting_first: float | None = None
    waiting_last: float | None = None
    waiting_max: float | None = None
    kv_cache_usage_max: float | None = None
    preemptions: float | None = None
    dispatch_lag_p99_ms: float | None = None
    asked_rate: float | None = None
    arrived_rate: float | None = None
    completed_rate: float | None = None
    client_lag_p90_ms: float | None = None
    slot_wait_p90_ms: float | None = None
    queue_growth: float | None = None
    client_cpu: float | None = None
    client_workers: int | None = None


class CapacityStep(BaseModel):
    """One load step as measured (re-measurements are steps of their own).

    ``requests``, ``failed`` and the percentiles are the measured part's;
    ``warmup_requests`` were sent before it (excluded), ``measured_s`` is its length.
    ``stationary``: the queue's steadiness (None: could not be told), in words in
    ``stationarity``; ``client_limit``: why the load generator limited the step;
    ``saturated``: why it failed on server evidence, every such evidence seen in
    ``saturation_evidence``.
    """

    index: int
    load: float
    requests: int
    failed: int
    duration_s: float | None = None
    percentiles: dict[str, dict[str, float]] = Field(default_factory=dict)
    goodput: float | None = None
    output_tokens_per_s: float | None = Field(None, description="the step's output tokens / s")
    output_tokens_per_s_per_user: float | None = Field(
        None, description="mean over requests of output tokens / (E2EL - TTFT): tokens/s/user"
    )
    signals: StepSignals = Field(default_factory=StepSignals)
    checks: list[SLOCheck] = Field(default_factory=list)
    saturated: str | None = None
    saturation_evidence: list[str] = Field(default_factory=list)
    stationary: bool | None = None
    stationarity: str | None = None
    client_limit: str | None = None
    warmup_requests: int = 0
    measured_s: float | None = None
    verdict: Verdict
    measurements: int = Field(
        1, description="measurements at this load whose records the checks pooled"
    )


def _checks(spec: CapacitySpec, pooled: StepValues) -> list[SLOCheck]:
    """Every objective's check on the pooled measurements: percentiles, then goodput."""
    checks: list[SLOCheck] = []
    for metric in METRICS:
        for name, objective in spec.slos.get(metric, {}).items():
            checks.append(check_percentile(metric, name, objective, pooled, spec.confidence))
    if spec.goodput is not None:
        good = good_mask(pooled, spec.slos)
        checks.append(check_goodput(spec.goodput, good, spec.confidence))
    return checks


def _corroboration(waiting: str | None, dyn: StepDynamics, signals: StepSignals) -> list[str]:
    """What backs a saturated step's hard evidence: the server's waiting queue, the slot
    wait, a full KV cache, preemptions."""
    evidence = [waiting] if waiting else []
    if dyn.slot_wait_text:
        evidence.append(dyn.slot_wait_text)
    if signals.kv_cache_usage_max is not None and signals.kv_cache_usage_max >= KV_FULL:
        evidence.append(f"KV cache usage reached {signals.kv_cache_usage_max:.0%}")
    if signals.preemptions:
        evidence.append(f"{signals.preemptions:g} requests preempted")
    return evidence


def decide(
    spec: CapacitySpec,
    index: int,
    load: float,
    plan: StepPlan,
    dyn: StepDynamics,
    own: StepValues,
    pooled: StepValues,
    count: int,
    growth: list[Growth],
    signals: StepSignals,
    duration_s: float | None,
    cut: bool,
) -> CapacityStep:
    checks = _checks(spec, pooled)
    stationary, why = _stationarity(spec, plan, dyn, growth)
    behind = client_fell_behind(dyn) if stationary is False else None
    if behind and not dyn.client_limits:
        dyn.client_limits.append(behind)
    hard = _hard_evidence(own, plan, cut)
    waiting = _waiting_growth(spec, own, signals)
    if stationary is False and not dyn.client_limits and dyn.queue_text:
        hard.append(f"the queue grew: {dyn.queue_text}")
    elif waiting and (dyn.client_limits or dyn.growth is None):
        hard.append(waiting)  # the server's own queue: evidence whatever the client did
        waiting = None
    evidence = [*hard, *_corroboration(waiting, dyn, signals)] if hard else []
    verdicts = {c.verdict for c in checks}
    verdict: Verdict = (
        "uncertain"
        if pooled.requests == 0  # nothing measured (no request, or warm-up only)
        else "fail"
        if hard
        else "client_limited"
        if dyn.client_limits
        else "fail"
        if "fail" in verdicts
        else "uncertain"
        if stationary is not True or "uncertain" in verdicts
        else "pass"
    )
    own_good = good_mask(own, spec.slos)
    wall = dyn.measured_wall_s or duration_s
    return CapacityStep(
        index=index,
        load=load,
        requests=own.requests,
        failed=own.failed,
        duration_s=duration_s,
        percentiles=_percentiles(spec, own),
        goodput=float(own_good.mean()) if own_good.size else None,
        output_tokens_per_s=own.output_tokens / wall if wall else None,
        output_tokens_per_s_per_user=(
            float(np.mean(own.tokens_per_s_per_user)) if own.tokens_per_s_per_user else None
        ),
        signals=signals,
        checks=checks,
        saturated="; ".join(hard) if hard else None,
        saturation_evidence=evidence,
        stationary=stationary,
        stationarity=why,
        client_limit="; ".join(dyn.client_limits) if dyn.client_limits else None,
        warmup_requests=dyn.warmup_requests,
        measured_s=dyn.measured_s,
        verdict=verdict,
        measurements=count,
    )


def _stationarity(
    spec: CapacitySpec, plan: StepPlan, dyn: StepDynamics, growth: list[Growth]
) -> tuple[bool | None, str]:
    """Whether the queue was stationary over the measured part(s), and why."""
    if dyn.too_short is not None and not growth:
        return None, f"too short to tell: {dyn.too_short}"
    if plan.variable == "concurrency" or dyn.growth is None:
        return True, "closed loop: the concurrency bounds the queue; long enough"
    stationary, g, se, arrivals = growth_verdict(growth, spec.confidence)
    words = {True: "stationary", False: "growing", None: "too noisy to tell"}[stationary]
    text = (
        f"{words}: queue growth {g:+.1f} requests (margin {se:.1f}) over {arrivals} measured "
        f"arrivals (limit {GROWTH_FRACTION * arrivals:.1f})"
    )
    if plan.short:
        text += f"; {plan.short}"
    return stationary, text


def _hard_evidence(values: StepValues, plan: StepPlan, cut: bool) -> list[str]:
    """Failed and unfinished requests: server evidence that fails the step (rule 2)."""
    out: list[str] = []
    if cut:
        out.append(
            f"requests were still unfinished {plan.drain_s:.3g} s after the step's last "
            "arrival: the step was cut there"
        )
    if values.requests and values.failed > SATURATION_FAILED_FRACTION * values.requests:
        out.append(f"{values.failed} of {values.requests} requests failed")
    return out


def _waiting_growth(spec: CapacitySpec, values: StepValues, signals: StepSignals) -> str | None:
    """The server's waiting queue grew through an open-loop step (rule 2), in words."""
    first, last, most = signals.waiting_first, signals.waiting_last, signals.waiting_max
    if spec.variable != "request_rate" or first is None or last is None or not most:
        return None
    threshold = max(1.0, SATURATION_WAITING_FRACTION * values.requests)
    if last - first <= threshold:
        return None
    return (
        f"the server's waiting requests grew from {first:g} to {last:g} through the step "
        f"(threshold {threshold:g})"
    )


def _percentiles(spec: CapacitySpec, values: StepValues) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for metric in METRICS:
        data = values.metric(metric)
        if not data:
            continue
        names = sorted({*REPORTED_PERCENTILES, *spec.slos.get(metric, {})}, key=percentile_of)
        out[metric] = {n: float(np.percentile(data, percentile_of(n))) for n in names}
    return out
