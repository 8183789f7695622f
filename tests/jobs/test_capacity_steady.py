"""The capacity search's steady-state and client-limit decisions, over many simulated queues.

No real time: :func:`simulate` is a discrete-event model of one load step, exact for
its assumptions. The server has ``slots`` slots and a FIFO queue, each request holds
a slot for a fixed service time ``S`` (so its capacity, the truth, is ``slots / S``
requests/s). The load generator sends the step's requests in list order at their due
times (constant or Poisson arrivals, scaled as the runner does:
:func:`jobs.capacity.stepplan.scale_schedule`), at most ``in_flight`` at once, and each
dispatch costs it ``1 / client_rate`` seconds of its single thread (its ceiling; None:
free), so it falls behind above its ceiling as a real client does. The records and
the server's ``num_requests_waiting`` at the first and last dispatch are what the
runner would hand the search.

The objectives are loose (TTFT p50 under 100 service times) so that only the steadiness
and client rules can stop an overloaded step; the properties are checked over many
seeds, loads up to 10x the boundary and the smallest steps the schema allows.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import pytest

from jobs.capacity.search import (
    CapacityResult,
    CapacitySearch,
    CapacitySpec,
    StepPlan,
    StepSignals,
    run_search,
)
from jobs.capacity.stepplan import scale_schedule
from jobs.schemas import RequestRecord

TOKENS = 4
SMALLEST = {"min_step_s": 0.5, "step_time_factor": 1.0}  # the schema's shortest steps


def simulate(
    plan: StepPlan,
    *,
    slots: int,
    service_s: float,
    seed: int,
    poisson: bool = True,
    client_rate: float | None = None,
) -> tuple[list[RequestRecord], StepSignals, float]:
    """One step as planned, against the model in the module docstring."""
    rng = np.random.default_rng(seed)
    n = plan.requests
    if plan.variable == "request_rate":
        if poisson:
            raw = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / plan.load, n - 1))])
        else:
            raw = np.arange(n) / plan.load
        due_at = scale_schedule(list(raw), plan)
    else:
        due_at = [0.0] * n
    dispatch_cost = 1.0 / client_rate if client_rate else 0.0
    origin = 10.0  # the run's clock: the step begins 10 s into the run
    in_flight: list[float] = []  # ends of the requests the client has in flight
    free_at = [origin] * slots  # when each server slot frees (a heap)
    client_free = origin
    records: list[RequestRecord] = []
    queued: list[tuple[float, float]] = []  # (arrival, service start) of those that waited
    for i in range(n):
        due = origin + due_at[i]
        t = max(due, client_free)
        while in_flight and in_flight[0] <= t:
            heapq.heappop(in_flight)
        while len(in_flight) >= plan.in_flight:
            t = max(t, heapq.heappop(in_flight))
        client_free = t + dispatch_cost
        begin = max(t, heapq.heappop(free_at))
        end = begin + service_s
        heapq.heappush(free_at, end)
        heapq.heappush(in_flight, end)
        if begin > t:
            queued.append((t, begin))
        ttft = begin + service_s / TOKENS - t
        records.append(
            RequestRecord(
                index=i,
                success=True,
                start_s=t,
                scheduled_s=due if plan.variable == "request_rate" else None,
                ttft_s=ttft,
                itl_s=[(end - begin - service_s / TOKENS) / (TOKENS - 1)] * (TOKENS - 1),
                tpot_s=(end - t - ttft) / (TOKENS - 1),
                e2el_s=end - t,
                output_tokens=TOKENS,
            )
        )

    joins = np.sort([a for a, _ in queued])
    leaves = np.sort([b for _, b in queued])

    def waiting(at: float) -> float:
        return float(np.searchsorted(joins, at, "right") - np.searchsorted(leaves, at, "right"))

    first, last = records[0].start_s, records[-1].start_s
    wall = max(r.start_s + (r.e2el_s or 0.0) for r in records) - origin
    signals = StepSignals(
        waiting_first=waiting(first),
        waiting_last=waiting(last),
        waiting_max=max((waiting(a) for a in joins), default=0.0),
        client_cpu=n * dispatch_cost / wall if client_rate else None,
        client_workers=1 if client_rate else None,
    )
    return records, signals, wall


def search(
    spec: dict[str, object],
    *,
    slots: int,
    service_s: float,
    seed: int,
    poisson: bool = True,
    client_rate: float | None = None,
    client_ceiling: float | None = None,
    in_flight: int | None = None,
) -> CapacityResult:
    steps = iter(range(1_000))

    def step(plan: StepPlan) -> tuple[Sequence[RequestRecord], StepSignals, float | None]:
        return simulate(
            plan,
            slots=slots,
            service_s=service_s,
            seed=seed * 1000 + next(steps),
            poisson=poisson,
            client_rate=client_rate,
        )

    return run_search(
        CapacitySpec.model_validate(spec),
        step,
        client_ceiling=client_ceiling,
        unloaded_s=service_s,
        in_flight=in_flight,
    )


def _spec(truth: float, service_s: float, top: float = 10, **extra: object) -> dict[str, object]:
    """Loose objectives, loads from ``truth / 5`` to ``top`` times it."""
    return {
        "slos": {"ttft_ms": {"p50": 100 * service_s * 1000}},
        "min": truth / 5,
        "max": truth * top,
        "tolerance": 0.05,
        "max_drain_s": 1000.0,
        **extra,
    }


def _trace(result: CapacityResult) -> list[tuple[float, str, str | None]]:
    return [(round(s.load, 2), s.verdict, s.stationarity) for s in result.steps]


@pytest.mark.parametrize(("slots", "service_s"), [(1, 0.05), (4, 0.2), (16, 0.4)])
@pytest.mark.parametrize("poisson", [True, False])
def test_the_search_never_reports_more_than_10_percent_above_the_truth(
    slots: int, service_s: float, poisson: bool
) -> None:
    truth = slots / service_s
    for seed in range(15):
        result = search(
            _spec(truth, service_s, **SMALLEST),
            slots=slots,
            service_s=service_s,
            seed=seed,
            poisson=poisson,
        )
        low = result.interval[0]
        assert result.capacity is None or result.capacity <= 1.1 * truth, _trace(result)
        assert low is None or low <= 1.1 * truth, _trace(result)  # no pass above it
        assert result.status not in ("at_least_max", "client_limited"), _trace(result)
        assert all(s.verdict != "pass" or s.load <= 1.1 * truth for s in result.steps)


@pytest.mark.parametrize(
    ("slots", "service_s", "min_step_s", "poisson"),
    [(4, 0.2, 60.0, True), (16, 0.4, 20.0, True), (16, 0.4, 5.0, False), (1, 0.05, 5.0, False)],
)
def test_steps_long_enough_find_the_boundary(
    slots: int, service_s: float, min_step_s: float, poisson: bool
) -> None:
    truth = slots / service_s
    found = []
    for seed in range(9):
        result = search(
            _spec(truth, service_s, top=2, min_step_s=min_step_s),
            slots=slots,
            service_s=service_s,
            seed=seed,
            poisson=poisson,
        )
        assert result.status in ("found", "uncertain"), _trace(result)
        if result.capacity is not None:
            assert 0.9 * truth <= result.capacity <= 1.1 * truth, _trace(result)
            found.append(result.capacity)
    assert len(found) >= 6  # decisive: most searches end with the boundary


@pytest.mark.parametrize("smallest", [False, True])
@pytest.mark.parametrize("poisson", [True, False])
def test_a_boundary_above_the_client_ceiling_is_client_limited(
    smallest: bool, poisson: bool
) -> None:
    slots, service_s, client_rate = 16, 0.016, 400.0  # server 1000 req/s, client 400
    truth = slots / service_s
    for seed in range(8):
        extra = SMALLEST if smallest else {"min_step_s": 2.0}
        result = search(
            _spec(truth, service_s, top=2.5, **extra),
            slots=slots,
            service_s=service_s,
            seed=seed,
            poisson=poisson,
            client_rate=client_rate,
        )
        trace = [(round(s.load), s.verdict, s.client_limit, s.saturated) for s in result.steps]
        assert result.status not in ("found", "at_least_max", "below_min"), trace
        assert not any(s.saturated for s in result.steps), trace
        assert "saturat" not in (result.note or ""), trace
        if result.status != "client_limited":
            assert smallest, trace  # only the shortest steps may be too short to tell
            continue
        ceiling = result.client_ceiling
        assert ceiling is not None and ceiling <= client_rate, trace
        assert result.capacity is None and result.interval[1] is None
        low = result.interval[0]
        assert low is None or low <= client_rate
        note = result.note or ""
        assert f"the load generator's ceiling here is {ceiling:.4g} req/s" in note
        assert f"at least {low:g} req/s" in note if low is not None else "no step passed" in note
        assert "load-generator worker processes" in note and "another node" in note


def test_a_known_client_ceiling_keeps_the_search_under_it() -> None:
    slots, service_s = 16, 0.016
    truth = slots / service_s
    result = search(
        _spec(truth, service_s, min_step_s=2.0),
        slots=slots,
        service_s=service_s,
        seed=3,
        poisson=False,
        client_ceiling=300.0,
    )
    assert max(s.load for s in result.steps) == 300.0
    assert result.status == "client_limited" and result.interval == (300.0, None)
    assert result.client_ceiling == 300.0 and "calibrated" in (result.note or "")
    below_min = CapacitySearch(
        CapacitySpec.model_validate(_spec(truth, service_s)), client_ceiling=50
    )
    assert below_min.next_load() is None
    assert below_min.result().status == "client_limited"


@pytest.mark.parametrize("seed", range(20))
def test_a_short_burst_never_passes(seed: int) -> None:
    # the step: 40 requests at 200 req/s (0.2 s of arrivals) on a server of
    # 30 req/s: the step lasts ~1.3 s, its queue grows through the arrivals
    slots, service_s = 4, 4 / 30
    spec = CapacitySpec.model_validate(_spec(30.0, service_s, **SMALLEST))
    burst = StepPlan(
        load=200.0,
        variable="request_rate",
        requests=40,
        span_s=39 / 200,
        warmup_requests=8,
        warmup_s=8 / 200,
        drain_s=1000.0,
        in_flight=64,
        unloaded_s=service_s,
    )
    records, signals, wall = simulate(burst, slots=slots, service_s=service_s, seed=seed)
    assert 1.0 < wall < 1.6
    step = CapacitySearch(spec, unloaded_s=service_s).record(200, records, signals, plan=burst)
    assert step.verdict != "pass", step.stationarity
    # the same 40 requests below the capacity: too few to tell a steady state
    calm = StepPlan(**{**burst.__dict__, "load": 20.0, "span_s": 39 / 20, "warmup_s": 8 / 20})
    records, signals, _ = simulate(calm, slots=slots, service_s=service_s, seed=seed)
    step = CapacitySearch(spec, unloaded_s=service_s).record(20, records, signals, plan=calm)
    assert step.verdict == "uncertain" and step.stationary is None


@pytest.mark.parametrize("poisson", [True, False])
def test_client_lag_with_nothing_waiting_is_never_saturation(poisson: bool) -> None:
    # a server 10x faster than the client: its queue stays empty at every load
    slots, service_s, client_rate = 64, 0.016, 400.0
    for seed in range(6):
        spec = _spec(client_rate, service_s, min_step_s=1.0)
        result = search(
            spec,
            slots=slots,
            service_s=service_s,
            seed=seed,
            poisson=poisson,
            client_rate=client_rate,
        )
        for s in result.steps:
            assert s.signals.waiting_max == 0
            assert s.saturated is None and s.verdict != "fail", (s.load, s.client_limit)
        assert result.binding_slo is None
        lagging = [s for s in result.steps if s.load > client_rate]
        assert lagging and all(s.verdict == "client_limited" for s in lagging)


def test_a_full_in_flight_cap_is_server_evidence_when_the_server_slows() -> None:
    # the open loop's in-flight cap (16) is full because the server (4 slots) holds the
    # requests in its own queue: they take far longer than unloaded, the lateness is the
    # server's
    slots, service_s = 4, 0.2
    spec = CapacitySpec.model_validate(_spec(20.0, service_s, min_step_s=5.0))
    search_ = CapacitySearch(spec, unloaded_s=service_s, in_flight=16)
    plan = search_.plan(40.0)
    records, signals, _ = simulate(plan, slots=slots, service_s=service_s, seed=1)
    step = search_.record(40.0, records, signals, plan=plan)
    assert step.verdict == "fail" and step.client_limit is None
    assert step.saturated and "queue grew" in step.saturated
    assert any("in-flight cap (16) was full" in e for e in step.saturation_evidence)
    assert step.signals.slot_wait_p90_ms and step.signals.slot_wait_p90_ms > 1000
    assert step.signals.client_lag_p90_ms == pytest.approx(0.0, abs=1.0)
    assert step.signals.arrived_rate and step.signals.arrived_rate < 25  # of 40 asked
    assert step.signals.asked_rate == pytest.approx(40.0)


@pytest.mark.parametrize("cap", [1, 4])
def test_an_in_flight_cap_that_holds_the_load_back_is_the_clients(cap: int) -> None:
    # a server of 64 slots (320 req/s) behind a cap of 1 or 4: requests take their
    # unloaded time and the rest wait in the client; never "the server saturated"
    slots, service_s = 64, 0.2
    spec = CapacitySpec.model_validate(_spec(320.0, service_s, min_step_s=5.0))
    search_ = CapacitySearch(spec, unloaded_s=service_s, in_flight=cap)
    plan = search_.plan(40.0)
    records, signals, _ = simulate(plan, slots=slots, service_s=service_s, seed=1)
    step = search_.record(40.0, records, signals, plan=plan)
    assert step.verdict == "client_limited" and step.saturated is None
    assert step.client_limit and f"in-flight cap ({cap}" in step.client_limit
    assert "raise the workload's concurrency" in step.client_limit
    result = search(
        _spec(320.0, service_s), slots=slots, service_s=service_s, seed=2, in_flight=cap
    )
    assert result.status in ("client_limited", "uncertain"), _trace(result)
    assert result.binding_slo != "saturated" and result.capacity is None


def test_waiting_for_a_previous_turn_is_not_a_client_limit() -> None:
    # multi-turn, turn by turn in list order: every turn 1 is due before its turn 0 has
    # finished (5 s each), so it waits (and the requests behind it in list order): the
    # server's time, not the load generator's
    turns, e2el, load = 40, 5.0, 10.0
    records = []
    for i in range(2 * turns):
        conversation, turn = i % turns, i // turns
        due = i / load
        sent = due if turn == 0 else max(due, conversation / load + e2el)
        records.append(
            RequestRecord(
                index=i,
                success=True,
                start_s=sent,
                scheduled_s=due,
                ttft_s=0.1,
                e2el_s=e2el,
                output_tokens=TOKENS,
                conversation=conversation,
                turn=turn,
            )
        )
    plan = StepPlan(
        load=load,
        variable="request_rate",
        requests=2 * turns,
        span_s=(2 * turns - 1) / load,
        warmup_requests=16,
        warmup_s=1.6,
        drain_s=30.0,
        in_flight=1000,
        unloaded_s=e2el,
    )
    spec = CapacitySpec.model_validate({"slos": {"e2el_ms": {"p50": 30_000}}, "min": 1, "max": 20})
    step = CapacitySearch(spec).record(load, records, StepSignals(), plan=plan)
    assert step.verdict != "client_limited" and step.client_limit is None
    assert step.signals.client_lag_p90_ms == pytest.approx(0.0, abs=1.0)
    assert step.signals.slot_wait_p90_ms == pytest.approx(1000.0, abs=5.0)
