"""Tests of jobs.capacity.search: the decision rules on synthetic steps, and the honest accuracy
test.

Synthetic steps (:func:`_steady`) are stable open-loop (or closed-loop) steps laid out
on the step's own plan: warm-up requests, then one measured request per given TTFT,
due every ``1 / load`` seconds and lasting their TTFT plus the decode time. The
search's decisions over many simulated queues (steadiness, client limits) are in
``tests/jobs/test_capacity_steady.py``.

The accuracy tests run the search against :class:`jobs.stub.stubserver.StubServer` in
capacity mode (a subprocess: ``slots`` requests served at once, FIFO queue, a fixed
service time ``S = ttft + (n - 1) * itl``), driven by :func:`jobs.load.loadgen.run_load`
with the first requests of the same request list each step, as planned by the search.
Closed form: arrivals see no queue up to about ``slots / S`` requests/s and a queue
growing without bound beyond it; in a closed loop a concurrency above ``slots`` makes
every request wait about ``S * (k - slots) / slots``, so an objective under base +
``S / slots`` has capacity ``slots``. The stub tests put their objectives on p90: the
p99 of few requests is about their maximum, which on a loaded shared machine is one
timer spike.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from jobs.capacity.search import (
    CapacityResult,
    CapacitySearch,
    CapacitySpec,
    CapacityStep,
    StepPlan,
    StepSignals,
    percentile_interval,
    run_search,
    step_values,
)
from jobs.load.loadgen import run_load
from jobs.schemas import ChatRequest, RequestRecord
from jobs.signals.enginemetrics import parse_metrics
from jobs.stub.stubserver import StubServer

Step = Callable[[StepPlan], tuple[Sequence[RequestRecord], StepSignals, float | None]]


def _steady(
    plan: StepPlan,
    ttft_ms: Sequence[float],
    *,
    tpot_ms: float = 5.0,
    tokens: int = 11,
    failed: int = 0,
    lag_ms: float = 0.0,
) -> list[RequestRecord]:
    """A stable step on ``plan``: its warm-up part, then one measured request per value
    of ``ttft_ms`` (and ``failed`` failed ones), evenly spaced, each sent ``lag_ms`` late
    (open loop) and lasting ``ttft + (tokens - 1) * tpot``."""
    count = len(ttft_ms) + failed
    if plan.variable == "request_rate":
        gap, warm = 1.0 / plan.load, plan.warmup_requests
    else:
        total = math.ceil(count / (1.0 - plan.warmup_s / plan.span_s))
        gap, warm = plan.span_s / total, total - count
    out = []
    for i in range(warm + count):
        due = i * gap
        ttft = ttft_ms[(i - warm) % len(ttft_ms)] if ttft_ms else 10.0
        ok = i < warm + len(ttft_ms)
        e2el = ttft + tpot_ms * (tokens - 1)
        out.append(
            RequestRecord(
                index=i,
                success=ok,
                error=None if ok else "x",
                start_s=due + lag_ms / 1000,
                scheduled_s=due if plan.variable == "request_rate" else None,
                ttft_s=ttft / 1000 if ok else None,
                itl_s=[tpot_ms / 1000] * (tokens - 1) if ok else [],
                tpot_s=tpot_ms / 1000 if ok else None,
                e2el_s=e2el / 1000 if ok else None,
                output_tokens=tokens if ok else None,
            )
        )
    return out


def _record(
    search: CapacitySearch,
    load: float,
    ttft_ms: Sequence[float],
    signals: StepSignals | None = None,
    **kw: Any,
) -> CapacityStep:
    plan = search.plan(load)
    return search.record(load, _steady(plan, ttft_ms, **kw), signals or StepSignals(), plan=plan)


def _noisy(center: float, spread: float, n: int = 60, seed: int = 0) -> list[float]:
    return list(np.random.default_rng(seed).normal(center, spread, n))


def _threshold_step(boundary: float, *, good: float = 50.0, bad: float = 150.0) -> Step:
    """A synthetic server: TTFT ``good`` ms up to ``boundary``, ``bad`` ms above it."""

    def step(plan: StepPlan) -> tuple[Sequence[RequestRecord], StepSignals, float | None]:
        ttft = good if plan.load <= boundary else bad
        return _steady(plan, _noisy(ttft, 2.0, seed=int(plan.load * 1000))), StepSignals(), 1.0

    return step


TTFT_SPEC = {"slos": {"ttft_ms": {"p90": 100.0}}, "min_step_s": 1.0}
# p90 of 60 values at the objective: its order-statistic interval (x(49) .. x(59) at
# 95 %) runs from 50 ms to 130 ms and straddles 100 ms
STRADDLE = [50.0] * 52 + [90.0, 100.0, 100.0, 110.0, 120.0, 130.0, 130.0, 130.0]


# -- decisions on synthetic records ------------------------------------------------------


def test_step_values_follow_vllm_definitions_and_count_failures() -> None:
    plan = CapacitySearch(CapacitySpec.model_validate({**TTFT_SPEC, "min": 1, "max": 2})).plan(1)
    records = [r for r in _steady(plan, [10.0, 20.0], tpot_ms=4.0, tokens=3, failed=1)][-3:]
    values = step_values(records)
    assert values.requests == 3 and values.failed == 1 and values.output_tokens == 6
    assert values.ttft_ms == pytest.approx([10.0, 20.0])
    assert values.tpot_ms == pytest.approx([4.0, 4.0])
    assert values.itl_ms == pytest.approx([4.0] * 4)
    assert values.e2el_ms == pytest.approx([18.0, 28.0])
    assert values.per_request[2] is None
    warm = RequestRecord(index=9, warmup=True, success=True, start_s=0, ttft_s=1, e2el_s=1)
    assert step_values([warm]).requests == 0


def test_pass_fail_and_uncertain_from_the_percentile_interval() -> None:
    spec = CapacitySpec.model_validate({**TTFT_SPEC, "min": 1, "max": 10, "remeasure": 0})
    ok = _record(CapacitySearch(spec), 1, _noisy(50, 5))
    assert ok.verdict == "pass" and ok.stationary is True
    assert ok.requests == 60 and ok.warmup_requests > 0  # the warm-up part is left out
    (check,) = ok.checks
    assert check.ci_low is not None and check.ci_high is not None and check.value is not None
    assert check.ci_low <= check.value <= check.ci_high <= 100
    assert ok.percentiles["ttft_ms"]["p90"] == pytest.approx(check.value)
    assert set(ok.percentiles["ttft_ms"]) == {"p50", "p90", "p99"}
    bad = _record(CapacitySearch(spec), 1, _noisy(200, 5))
    assert bad.verdict == "fail" and bad.checks[0].ci_low is not None
    assert bad.checks[0].ci_low > 100
    # p90 right at the objective: the interval straddles it
    search = CapacitySearch(spec)
    step = _record(search, 1, STRADDLE)
    assert step.verdict == "uncertain"
    assert search.next_load() is None
    result = search.result()
    assert result.status == "uncertain" and result.capacity is None
    assert result.interval == (None, None) and result.note and "ttft_ms:p90" in result.note


def test_the_warmup_part_is_excluded_from_the_decision() -> None:
    # the warm-up part's requests are slow (a cold server), the measured part's fast
    spec = CapacitySpec.model_validate({**TTFT_SPEC, "min": 1, "max": 10, "remeasure": 0})
    search = CapacitySearch(spec)
    plan = search.plan(2)
    records = _steady(plan, [50.0] * 60)
    cold = [
        r.model_copy(update={"ttft_s": 0.5, "e2el_s": 0.55}) if i < plan.warmup_requests else r
        for i, r in enumerate(records)
    ]
    step = search.record(2, cold, StepSignals(), plan=plan)
    assert step.verdict == "pass" and step.warmup_requests == plan.warmup_requests
    assert step.percentiles["ttft_ms"]["p99"] == pytest.approx(50.0)
    assert step.measured_s == pytest.approx(59 / 2)


def test_an_uncertain_step_is_measured_again_with_pooled_records() -> None:
    spec = CapacitySpec.model_validate({**TTFT_SPEC, "min": 1, "max": 10, "remeasure": 2})
    search = CapacitySearch(spec)
    assert _record(search, 1, STRADDLE).verdict == "uncertain"
    assert search.next_load() == 1  # again, same load
    second = _record(search, 1, _noisy(40, 2, n=400))
    assert second.measurements == 2 and second.requests == 400  # own count, pooled checks
    assert second.verdict == "pass"
    assert search.next_load() == 10


def test_request_rate_bisects_geometrically_to_the_tolerance() -> None:
    spec = CapacitySpec.model_validate({**TTFT_SPEC, "min": 1, "max": 100, "tolerance": 0.05})
    result = run_search(spec, _threshold_step(37.0))
    assert result.status == "found" and result.capacity is not None
    lo, hi = result.interval
    assert lo == result.capacity and hi is not None
    assert lo <= 37.0 < hi and (hi - lo) / lo <= 0.05
    loads = [s.load for s in result.steps]
    assert loads[:4] == pytest.approx([1, 100, 10, math.sqrt(1000)])
    assert len(loads) <= 10 and result.binding_slo == "ttft_ms:p90"
    assert result.note is None and result.client_ceiling is None


def test_a_step_lasts_the_minimum_duration_and_requests_per_step_is_a_floor() -> None:
    spec = CapacitySpec.model_validate(
        {**TTFT_SPEC, "min": 1, "max": 100, "min_step_s": 5.0, "requests_per_step": 80}
    )
    search = CapacitySearch(spec, unloaded_s=0.5)  # 20 unloaded requests: 10 s
    fast = search.plan(50)
    assert fast.requests == 50 * 10 + 1 and fast.span_s == pytest.approx(10)
    slow = search.plan(2)  # the floor: 80 requests at 2 req/s
    assert slow.requests == 80 and slow.span_s == pytest.approx(79 / 2)
    assert slow.warmup_requests == 16 and slow.warmup_s == pytest.approx(8.0)
    assert fast.drain_s == 30.0 and fast.short is None
    capped = CapacitySearch(spec, unloaded_s=20.0).plan(50)  # 400 s wanted, 300 allowed
    assert capped.span_s == pytest.approx(300) and capped.short and "max_step_s" in capped.short
    listed = CapacitySearch(spec, unloaded_s=0.5, available=300).plan(50)
    assert listed.requests == 300 and listed.short and "request list" in listed.short


def test_the_drain_limit_covers_every_objective() -> None:
    # a spec stored before the steady-state fields existed still loads, and its steps
    # are cut no sooner than its longest TTFT/E2EL objective
    old = CapacitySpec.model_validate({"slos": {"e2el_ms": {"p50": 60_000}}, "min": 1, "max": 9})
    assert old.drain_s() == 60.0 and old.min_step_s == 10.0 and old.max_step_s == 300.0
    assert CapacitySpec.model_validate({**TTFT_SPEC, "min": 1, "max": 9}).drain_s() == 30.0
    assert CapacitySearch(old, unloaded_s=20.0).plan(1).drain_s == 80.0  # 4 request times


def test_concurrency_loads_are_integers_and_stop_at_adjacent_levels() -> None:
    spec = CapacitySpec.model_validate(
        {**TTFT_SPEC, "variable": "concurrency", "min": 1.5, "max": 40.7}
    )
    result = run_search(spec, _threshold_step(7))
    loads = [s.load for s in result.steps]
    assert all(load == int(load) for load in loads)
    assert loads[:3] == [2, 40, 21]
    assert result.status == "found" and result.capacity == 7 and result.interval == (7, 8)


def test_below_min_and_at_least_max() -> None:
    spec = CapacitySpec.model_validate({**TTFT_SPEC, "min": 5, "max": 50})
    low = run_search(spec, _threshold_step(1))
    assert low.status == "below_min" and low.capacity is None and low.interval == (None, 5)
    assert len(low.steps) == 1 and low.binding_slo == "ttft_ms:p90"
    high = run_search(spec, _threshold_step(1000))
    assert high.status == "at_least_max" and high.capacity is None
    assert high.interval == (50, None) and len(high.steps) == 2 and high.binding_slo is None


def test_steps_exhausted_keeps_the_bracket_but_no_capacity() -> None:
    spec = CapacitySpec.model_validate(
        {**TTFT_SPEC, "min": 1, "max": 1000, "tolerance": 0.01, "max_steps": 4}
    )
    result = run_search(spec, _threshold_step(37.0))
    assert result.status == "steps_exhausted" and result.capacity is None
    assert len(result.steps) == 4
    lo, hi = result.interval
    assert lo is not None and hi is not None and lo <= 37.0 < hi


def test_binding_slo_is_the_one_failing_at_the_lowest_failing_load() -> None:
    spec = CapacitySpec.model_validate(
        {"slos": {"ttft_ms": {"p90": 100}, "tpot_ms": {"p90": 10}}, "min": 1, "max": 100}
        | {"min_step_s": 1.0}
    )

    def step(plan: StepPlan) -> tuple[Sequence[RequestRecord], StepSignals, float | None]:
        ttft = 50.0 if plan.load <= 60 else 150.0  # TTFT breaks at 60
        tpot = 5.0 if plan.load <= 20 else 20.0  # TPOT breaks first, at 20
        return _steady(plan, _noisy(ttft, 1.0), tpot_ms=tpot), StepSignals(), 2.0

    result = run_search(spec, step)
    assert result.status == "found" and result.binding_slo == "tpot_ms:p90"
    assert result.capacity is not None and result.capacity <= 20
    first = result.steps[0]  # 60 measured requests of 11 tokens, one a second
    assert first.output_tokens_per_s == pytest.approx(60 * 11 / (59 + 0.1), rel=0.01)
    assert first.output_tokens_per_s_per_user == pytest.approx(11 / 0.05)


def test_goodput_objective_uses_the_fraction_with_failures_counted() -> None:
    spec = CapacitySpec.model_validate(
        {"slos": {"ttft_ms": {"p50": 1000}}, "goodput": 0.9, "min": 1, "max": 10}
        | {"min_step_s": 1.0}
    )
    # 20 % of the requests over 100 ms TTFT, but the goodput limit is the p50 objective
    fine = _record(CapacitySearch(spec), 1, [50.0] * 48 + [500.0] * 12)
    assert fine.verdict == "pass" and fine.goodput == 1.0
    strict = CapacitySpec.model_validate(
        {"slos": {"ttft_ms": {"p50": 100}}, "goodput": 0.9, "min": 1, "max": 10}
        | {"min_step_s": 1.0}
    )
    step = _record(CapacitySearch(strict), 1, [50.0] * 40 + [500.0] * 20)
    goodput = step.checks[-1]
    assert goodput.metric == "goodput" and goodput.value == pytest.approx(2 / 3)
    assert goodput.verdict == "fail" and step.verdict == "fail"
    # failed requests count as not good (and 1 of 61 stays under the saturation rule)
    one_failed = _record(CapacitySearch(spec), 1, [50.0] * 60, failed=1)
    assert one_failed.goodput == pytest.approx(60 / 61) and one_failed.saturated is None


def test_saturation_needs_server_evidence() -> None:
    spec = CapacitySpec.model_validate({**TTFT_SPEC, "min": 10, "max": 100})
    fast = _noisy(50, 1)
    failed = _record(CapacitySearch(spec), 10, fast, failed=4)
    assert failed.verdict == "fail" and failed.saturated and "failed" in failed.saturated
    assert failed.saturation_evidence == [failed.saturated]
    # the server's waiting queue growing alone, while the requests due and not done stay
    # level (a noisy scrape), fails nothing: the client-side queue is the finer measure
    growing = StepSignals(waiting_first=0, waiting_last=12, waiting_max=12)
    level = _record(CapacitySearch(spec), 10, fast, growing)
    assert level.verdict == "pass" and level.saturated is None
    # client dispatch lag with free slots and nothing waiting: the load generator's limit,
    # never saturation
    lagging = _record(CapacitySearch(spec), 10, fast, StepSignals(waiting_max=0), lag_ms=300)
    assert lagging.verdict == "client_limited" and lagging.saturated is None
    assert lagging.client_limit and "client lag" in lagging.client_limit
    assert lagging.signals.dispatch_lag_p99_ms == pytest.approx(300)
    assert lagging.signals.client_lag_p90_ms == pytest.approx(300)
    # ... unless the server's own queue grew meanwhile: that is the server's evidence
    both = _record(CapacitySearch(spec), 10, fast, growing, lag_ms=300)
    assert both.verdict == "fail" and both.saturated and "waiting" in both.saturated
    on_time = _record(CapacitySearch(spec), 10, fast, lag_ms=5)
    assert on_time.saturated is None and on_time.verdict == "pass"
    busy = _record(CapacitySearch(spec), 10, fast, StepSignals(client_cpu=0.97, client_workers=1))
    assert busy.verdict == "client_limited" and busy.client_limit and "core" in busy.client_limit
    # a saturated lowest failure binds as "saturated"
    result = run_search(spec, lambda plan: (_steady(plan, fast, failed=10), StepSignals(), 1.0))
    assert result.status == "below_min" and result.binding_slo == "saturated"


def test_a_step_cut_at_its_drain_limit_fails_with_its_unfinished_requests() -> None:
    spec = CapacitySpec.model_validate({**TTFT_SPEC, "min": 10, "max": 100})
    search = CapacitySearch(spec)
    plan = search.plan(10)
    records = _steady(plan, _noisy(50, 1))[: plan.requests - 10]  # 10 had no answer
    step = search.record(10, records, StepSignals(), plan=plan, cut=True)
    assert step.verdict == "fail" and step.saturated and "cut" in step.saturated
    assert step.failed >= 10
    # a load generator that had not even sent them: its limit, not the server's
    slow = _steady(plan, _noisy(50, 1), lag_ms=400)[: plan.requests - 10]
    step = CapacitySearch(spec).record(10, slow, StepSignals(), plan=plan, cut=True)
    assert step.verdict == "client_limited" and step.saturated is None
    assert step.client_limit and "cut" in step.client_limit and step.failed == 0


def test_the_search_is_deterministic() -> None:
    spec = CapacitySpec.model_validate({**TTFT_SPEC, "min": 1, "max": 100})
    one = run_search(spec, _threshold_step(37.0))
    two = run_search(spec, _threshold_step(37.0))
    assert one.model_dump() == two.model_dump()
    assert CapacityResult.model_validate_json(one.model_dump_json()) == one


def test_record_after_the_end_and_bad_specs_raise() -> None:
    spec = CapacitySpec.model_validate({**TTFT_SPEC, "min": 5, "max": 50})
    search = CapacitySearch(spec)
    _record(search, 5, [500.0] * 60)
    assert search.next_load() is None
    with pytest.raises(RuntimeError):
        _record(search, 5, [500.0] * 60)
    for bad, why in (
        ({"min": 1, "max": 10}, "objective"),
        ({**TTFT_SPEC, "min": 10, "max": 1}, "over max"),
        ({"slos": {"ttft_ms": {"q99": 100}}, "min": 1, "max": 10}, "q99"),
        ({**TTFT_SPEC, "variable": "concurrency", "min": 1.2, "max": 1.8}, "integer"),
        ({**TTFT_SPEC, "min": 1, "max": 10, "min_step_s": 20, "max_step_s": 10}, "max_step_s"),
        ({"slos": {"e2el_ms": {"p50": 60_000}}, "min": 1, "max": 10, "max_drain_s": 30}, "drain"),
        ({**TTFT_SPEC, "min": 1, "max": 10, "warmup_fraction": 0.0}, "warmup_fraction"),
        ({**TTFT_SPEC, "min": 1, "max": 10, "min_step_s": 0.1}, "min_step_s"),
    ):
        with pytest.raises(ValidationError, match=why):
            CapacitySpec.model_validate(bad)


def test_a_bracket_narrowed_on_the_last_allowed_step_is_found() -> None:
    # concurrency 2..5 with capacity 3: min 2 passes, max 5 fails, 3 passes, 4 fails:
    # the bracket (3, 4) is reached on step 4 = max_steps, and that is a boundary found
    spec = CapacitySpec.model_validate(
        {"slos": {"ttft_ms": {"p90": 250}}, "variable": "concurrency", "min": 2, "max": 5}
        | {"max_steps": 4, "min_step_s": 1.0}
    )
    search = CapacitySearch(spec)
    while (load := search.next_load()) is not None:
        _record(search, load, [100.0] * 60 if load <= 3 else [600.0] * 60)
    result = search.result()
    assert len(result.steps) == 4
    assert result.status == "found" and result.capacity == 3 and result.interval == (3, 4)


def test_a_high_percentile_of_few_requests_never_passes() -> None:
    # 60 requests all under the objective: a p99 is not bounded from above by 60 values
    # (P(all 60 under the true p99) = 0.99**60 = 55 %), so the step cannot pass; with
    # 400 such requests it can
    spec = CapacitySpec.model_validate(
        {"slos": {"ttft_ms": {"p99": 100}}, "min": 1, "max": 10, "remeasure": 0}
        | {"min_step_s": 1.0}
    )
    few = _record(CapacitySearch(spec), 1, [50.0] * 60)
    assert few.verdict == "uncertain" and few.checks[0].ci_high is None
    many = _record(CapacitySearch(spec), 1, [50.0] * 400)
    assert many.verdict == "pass"


def test_the_percentile_interval_covers_at_its_confidence() -> None:
    # coverage of the true p90 of an exponential over many synthetic steps of 60 values
    rng = np.random.default_rng(7)
    true_p90 = -math.log(0.1)
    misses, trials = 0, 400
    for _ in range(trials):
        lo, hi = percentile_interval(np.sort(rng.exponential(size=60)), 90, 0.95)
        assert lo is not None and hi is not None
        misses += not (lo <= true_p90 <= hi)
    assert misses / trials <= 0.07  # nominal 5 %, order statistics are conservative


def test_a_step_without_measured_requests_decides_nothing() -> None:
    spec = CapacitySpec.model_validate({**TTFT_SPEC, "min": 1, "max": 10, "remeasure": 0})
    warm = RequestRecord(index=0, warmup=True, success=True, start_s=0, ttft_s=0.01, e2el_s=0.02)
    step = CapacitySearch(spec).record(1, [warm], StepSignals())
    assert step.verdict == "uncertain" and step.requests == 0


def test_latencies_that_are_not_numbers_make_the_request_failed() -> None:
    bad = [
        RequestRecord(index=0, success=True, start_s=0, ttft_s=float("nan"), e2el_s=0.1),
        RequestRecord(index=1, success=True, start_s=0, ttft_s=-0.01, e2el_s=0.1),
        RequestRecord(index=2, success=True, start_s=0, ttft_s=0.01, e2el_s=0.02),
    ]
    values = step_values(bad)
    assert values.failed == 2 and values.ttft_ms == pytest.approx([10.0])


# -- the honest accuracy test: the stub in capacity mode ---------------------------------


def _waiting(base_url: str) -> float:
    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as resp:
        return parse_metrics(resp.read().decode())["num_requests_waiting"]


def stub_step(base_url: str, variable: str, requests: int, max_tokens: int) -> Step:
    """One step against the stub as the search planned it: the first requests of the same
    list each step (at least ``requests``), constant arrivals at the step's rate, or a
    closed loop dispatching for the step's length.

    Signals: the stub's waiting queue sampled every 50 ms while the step runs;
    ``waiting_first`` / ``waiting_last`` are the samples nearest the first and last
    dispatch.
    """

    def step(plan: StepPlan) -> tuple[Sequence[RequestRecord], StepSignals, float | None]:
        load = plan.load
        if variable == "request_rate":
            count = max(requests, plan.requests)
        else:  # enough for the loop's length at 20 requests/s per slot
            count = max(requests, math.ceil(load * plan.span_s * 20))
        reqs = [
            ChatRequest(
                index=i,
                messages=[{"role": "user", "content": f"question {i}"}],
                max_tokens=max_tokens,
                arrival_s=i / load if variable == "request_rate" else None,
            )
            for i in range(count)
        ]
        concurrency = count if variable == "request_rate" else int(load)
        samples: list[tuple[float, float]] = []
        done = threading.Event()
        origin = time.perf_counter()

        def sample() -> None:
            while not done.is_set():
                samples.append((time.perf_counter() - origin, _waiting(base_url)))
                done.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        dispatch = plan.span_s if variable == "concurrency" else None
        try:
            records = asyncio.run(
                run_load(
                    base_url,
                    "m",
                    reqs,
                    concurrency=concurrency,
                    clock_origin=origin,
                    duration_s=dispatch,
                )
            )
        finally:
            done.set()
            sampler.join()
        duration = time.perf_counter() - origin
        first = min(r.start_s for r in records)
        last = max(r.start_s for r in records)
        during = [w for t, w in samples if first <= t <= last + 0.05] or [0.0]
        signals = StepSignals(
            waiting_first=min(samples, key=lambda s: abs(s[0] - first))[1],
            waiting_last=min(samples, key=lambda s: abs(s[0] - last))[1],
            waiting_max=max(during),
        )
        return records, signals, duration

    return step


def measured_baseline(base_url: str, max_tokens: int, count: int = 20) -> tuple[float, float]:
    """This machine, now: the stub's p90 TTFT (ms) and median service time (s) at
    concurrency 1, where nobody waits for a slot.

    The stub promises a TTFT of ``ttft_s`` and a slot held ``ttft_s + (n - 1) * itl_s``
    from its own clock; a loaded machine adds its scheduling delays to both (the
    client's and the stub's wake-ups, the slot's release timer). Objectives and the
    true capacity are set from these, measured right before the search on the same
    stub, so a busy machine moves them as it moves what the search measures.
    """
    reqs = [
        ChatRequest(
            index=i, messages=[{"role": "user", "content": f"base {i}"}], max_tokens=max_tokens
        )
        for i in range(count)
    ]
    records = asyncio.run(run_load(base_url, "m", reqs, concurrency=1))
    assert all(r.success and r.ttft_s is not None and r.e2el_s is not None for r in records)
    ttft_p90_ms = float(np.percentile([(r.ttft_s or 0.0) * 1000 for r in records], 90))
    service_s = float(np.median([r.e2el_s or 0.0 for r in records]))
    return ttft_p90_ms, service_s


@pytest.fixture(scope="module")
def rate_stub() -> Iterator[StubServer]:
    """16 slots, S = 50 ms + 3 * 50 ms = 200 ms for 4 tokens: capacity 80 requests/s.

    Long enough that the timer jitter of a loaded 2-core machine (tens of ms) stays
    inside the objectives' margins, short enough that a 2 s step holds the ~150
    arrivals a steadiness verdict needs near the capacity; few tokens a request keep the
    stub's and the client's own CPU use small (320 chunks/s at the capacity).
    """
    with StubServer(0.05, 0.05, slots=16, process=True) as server:
        yield server


@pytest.mark.timing
def test_stub_capacity_mode_queues_fifo_and_reports_waiting(rate_stub: StubServer) -> None:
    reqs = [
        ChatRequest(index=i, messages=[{"role": "user", "content": "q"}], max_tokens=4)
        for i in range(32)
    ]
    seen: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(_waiting(rate_stub.base_url))
            stop.wait(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    records = asyncio.run(run_load(rate_stub.base_url, "m", reqs, concurrency=32))
    stop.set()
    watcher.join()
    # The stub's promise, in the server's terms: 16 slots, a base TTFT of 50 ms, a slot
    # busy S = 200 ms. On the clock of the run (start + TTFT), whenever the client got
    # the 32 requests out (a loaded machine dispatches them late), nobody beyond the 16
    # slots sees a first token before a slot freed, and nobody sees one under the base.
    assert all(r.success and r.ttft_s is not None for r in records)
    first_token = sorted(r.start_s + (r.ttft_s or 0.0) for r in records)
    t0 = min(r.start_s for r in records)
    assert all((r.ttft_s or 0.0) >= 0.05 for r in records), [r.ttft_s for r in records]
    assert all(t >= t0 + 0.2 + 0.05 for t in first_token[16:]), [t - t0 for t in first_token]
    # requests that arrived while the 16 slots were busy waited, and /metrics said so
    queued = [r for r in records if r.start_s < t0 + 0.2 and (r.ttft_s or 0.0) >= 0.2]
    if queued:
        assert max(seen) >= 1, seen
    assert rate_stub.stats()["slots"] == 16


@pytest.mark.timing
def test_capacity_search_finds_the_rate_capacity_of_the_stub(rate_stub: StubServer) -> None:
    # the stub promises 16 slots held S = 200 ms (80 requests/s); this machine's S and
    # base TTFT, measured now, set the truth (slots / S) and the objective: base TTFT +
    # S / 2 at p90. Above the capacity the queue grows (the steadiness rule fails the
    # step) and the TTFTs with it.
    base_p90_ms, service_s = measured_baseline(rate_stub.base_url, 4)
    assert service_s >= 0.2  # never faster than promised
    truth = 16 / service_s
    spec = CapacitySpec.model_validate(
        {"slos": {"ttft_ms": {"p90": base_p90_ms + service_s * 1000 / 2}}}
        | {"min": 20, "max": 160, "tolerance": 0.1}
        | {"min_step_s": 2.0, "step_time_factor": 5.0, "max_drain_s": 2.0}
    )
    result = run_search(spec, stub_step(rate_stub.base_url, "request_rate", 0, 4))
    trace = (
        "\n".join(
            f"{s.load:.1f} {s.verdict}: {s.stationarity}; {s.client_limit}; {s.saturated}"
            for s in result.steps
        )
        + f"\nbase p90 {base_p90_ms:.1f} ms, S {service_s * 1000:.1f} ms, truth {truth:.1f}"
    )
    assert result.status == "found", trace
    assert result.capacity is not None
    assert abs(result.capacity / truth - 1) <= 0.1, trace
    assert len(result.steps) <= 12
    assert result.binding_slo in ("ttft_ms:p90", "saturated")


@pytest.mark.timing
def test_capacity_search_finds_the_concurrency_capacity_of_the_stub() -> None:
    # 3 slots, S = 50 ms + 3 * 100 ms = 350 ms for 4 tokens. Up to 3 users nobody waits
    # (TTFT: the base measured at concurrency 1); with 4, every round of service one
    # request waits a whole S, so a quarter of the TTFTs are base + S: over the base + S
    # / 2 objective at p90. S / 2 = 175 ms is well above a loaded machine's single
    # delays (at S = 200 ms two of 34 requests at concurrency 2, with a spare slot, came
    # in over base + 100 ms), and steps of 5 s hold ~40 requests near the capacity,
    # where the p90's order-statistic interval decides both ways.
    with StubServer(0.05, 0.1, slots=3, process=True) as stub:
        base_p90_ms, service_s = measured_baseline(stub.base_url, 4, count=12)
        assert service_s >= 0.35  # never faster than promised
        spec = CapacitySpec.model_validate(
            {"slos": {"ttft_ms": {"p90": base_p90_ms + service_s * 1000 / 2}}}
            | {"variable": "concurrency", "min": 2, "max": 12}
            | {"min_step_s": 5.0, "step_time_factor": 1.0}
        )
        result = run_search(spec, stub_step(stub.base_url, "concurrency", 0, 4))
    trace = [(s.load, s.verdict, s.requests, s.stationarity) for s in result.steps] + [
        (base_p90_ms, service_s)
    ]
    assert result.status == "found" and result.capacity == 3 and result.interval == (3, 4), trace
    assert len(result.steps) <= 10


@pytest.mark.timing
def test_noisy_stub_reports_uncertain_not_a_wrong_capacity() -> None:
    # TTFT = 50 ms + lognormal noise (median 20 ms, sigma 1): its p90 (~72 ms) is the
    # objective, and its sample p90 over a short step is far too spread to decide
    noise_p90_ms = 20 * math.exp(1.2816 * 1.0)
    spec = CapacitySpec.model_validate(
        {"slos": {"ttft_ms": {"p90": 50 + noise_p90_ms}}, "min": 20, "max": 100}
        | {"tolerance": 0.1, "min_step_s": 1.0, "max_drain_s": 5.0}
    )
    with StubServer(0.05, 0.05, slots=16, noise_s=0.02, noise_sigma=1.0, process=True) as stub:
        result = run_search(spec, stub_step(stub.base_url, "request_rate", 0, 4))
    trace = [(s.load, s.verdict, s.checks[0].ci_low, s.checks[0].ci_high) for s in result.steps]
    # never a wrong number: uncertain, or a bracket that holds the truth (80 requests/s)
    assert result.capacity is None or abs(result.capacity / 80 - 1) <= 0.1, trace
    if result.status == "uncertain":
        assert result.capacity is None and result.note, trace
    else:
        assert result.status in ("found", "below_min"), trace


def test_a_step_whose_load_generator_stalled_is_client_limited_not_failed() -> None:
    """The same steady step passes; with a 1.2 s stall of the load generator in the middle of
    its measured part (its event loop could not run: a stopped or starved client) it is
    ``client_limited``, with the stall as the reason, never a fail blamed on the server.
    Stalls that moved no request and took under 5 % of the part change nothing, nor do
    stalls that lost under a second in all, even when they moved 5 % of the requests."""
    spec = CapacitySpec.model_validate({**TTFT_SPEC, "min": 1, "max": 10, "remeasure": 0})
    search = CapacitySearch(spec)
    plan = search.plan(1)
    records = _steady(plan, _noisy(50, 5))
    measured = [r for r in records if r.index >= plan.warmup_requests]
    middle = measured[len(measured) // 2].start_s
    assert CapacitySearch(spec).record(1, records, StepSignals(), plan=plan).verdict == "pass"
    step = CapacitySearch(spec).record(
        1, records, StepSignals(), plan=plan, stalls=[(middle - 0.6, middle + 0.6)]
    )
    assert step.verdict == "client_limited"
    assert "the load generator stalled" in str(step.client_limit)
    # a 0.15 s stall between requests (each 100 ms long, 1 s apart): none moved, 0.3 %
    gap = (measured[0].start_s + 0.5, measured[0].start_s + 0.65)
    quiet = CapacitySearch(spec).record(1, records, StepSignals(), plan=plan, stalls=[gap])
    assert quiet.verdict == "pass"
    # three 0.3 s stalls, each ending as a request ended: 3 of 50 moved (6 %), 0.9 s lost
    ends = [r.start_s + (r.e2el_s or 0.0) for r in measured[10:13]]
    hiccups = [(end - 0.3 + 1e-6, end + 1e-6) for end in ends]
    moved = CapacitySearch(spec).record(1, records, StepSignals(), plan=plan, stalls=hiccups)
    assert moved.verdict == "pass", moved.client_limit
    longer = [(a - 0.04, b) for a, b in hiccups]  # 1.02 s lost: the same three matter
    assert (
        CapacitySearch(spec).record(1, records, StepSignals(), plan=plan, stalls=longer).verdict
        == "client_limited"
    )
