"""Tests of jobs.load.loadceiling: the load generator's ceiling, measured against the stub where it
runs.

The rules of a sustained step are checked on given figures; the ramp runs for real on this
machine (a stub with 1 ms timing in a subprocess): asked far above what a process can send,
it ends with a finite ceiling under the lowest failing rate and says what failed.
"""

from __future__ import annotations

import asyncio

import pytest

from jobs.load.loadceiling import arrival_rates, judge_step, measure_ceiling
from jobs.schemas import ChatRequest, RequestRecord

REQUESTS = [
    ChatRequest(index=i, messages=[{"role": "user", "content": f"q {i} " * 20}], max_tokens=16)
    for i in range(8)
]


def test_judge_step_names_each_limit() -> None:
    assert judge_step(100, 99, 0, 50, 3.0, 0.3) == []
    assert judge_step(100, 90, 0, 50, 3.0, 0.3) == ["arrived 90.0 req/s (90%) of 100.0 asked"]
    assert judge_step(100, 99, 0, 50, 30.0, 0.3) == ["dispatch lag p99 30.0 ms > 25 ms"]
    cpu = judge_step(100, 99, 0, 50, 3.0, 0.95)
    assert cpu == ["client CPU 95% of a core per second of arrivals"]
    assert judge_step(100, 99, 2, 50, None, 0.1) == ["2 of 50 requests failed"]
    assert judge_step(100, None, 0, 1, None, 0.1) == ["arrived unknown of 100.0 asked"]
    assert judge_step(100, 99, 0, 50, 30.0, 0.3, max_lag_p99_ms=50) == []
    node = judge_step(100, 99, 0, 50, 3.0, 0.6, node_cpu=1.9, cores=2)
    assert node == ["client and stub need 1.90 cores per second of arrivals, 2 there"]
    assert judge_step(100, 99, 0, 50, 3.0, 0.6, node_cpu=1.7, cores=2) == []


def test_arrival_rates_from_due_times_and_starts() -> None:
    # due every 10 ms (100 req/s); sent every 12.5 ms (80 req/s)
    records = [
        RequestRecord(index=i, success=True, start_s=1 + i * 0.0125, scheduled_s=1 + i * 0.01)
        for i in range(9)
    ]
    asked, arrived = arrival_rates(records)
    assert asked is not None and arrived is not None
    assert abs(asked - 100) < 1e-6 and abs(arrived - 80) < 1e-6
    closed = [RequestRecord(index=0, success=True, start_s=0)]
    assert arrival_rates(closed) == (None, None)


@pytest.mark.timing
def test_a_rate_beyond_the_client_gives_a_finite_ceiling_with_its_evidence() -> None:
    heavy = [r.model_copy(update={"max_tokens": 64}) for r in REQUESTS]
    got = asyncio.run(measure_ceiling(heavy, start_rate=500, growth=2, max_rate=1e6, budget_s=6))
    failing = [s for s in got.steps if not s.sustained]
    assert failing and not got.at_least and got.limit, got
    assert got.failed_rps is not None and got.failed_rps < 1e6
    assert got.ceiling_rps is None or got.ceiling_rps < got.failed_rps
    # a failed rate was measured twice (a stall of a busy machine fails one short step)
    assert sum(s.asked_rate == got.failed_rps for s in got.steps) == 2
    top = got.at_ceiling()
    if top is not None:  # the evidence of the ceiling's step holds the rules
        assert top.asked_rate == got.ceiling_rps
        assert top.arrived_rate is not None and top.arrived_rate >= 0.95 * top.asked_rate
        assert top.failed == 0 and (top.dispatch_lag_p99_ms or 0) <= 25
        assert top.cpu_per_request_ms is not None and top.cpu_per_request_ms > 0
    assert all(s.limits for s in failing)
    assert got.workers == 1 and got.stub_ttft_s == 0.001
    assert got.elapsed_s < 30


@pytest.mark.timing
def test_a_ramp_that_reaches_max_rate_is_a_lower_bound() -> None:
    got = asyncio.run(measure_ceiling(REQUESTS, start_rate=20, max_rate=40, budget_s=5))
    assert got.ceiling_rps == 40 and got.at_least and got.limit is None
    assert sorted({s.asked_rate for s in got.steps}) == [20, 32, 40]


@pytest.mark.timing
def test_a_saturated_client_over_two_workers_has_no_ceiling_and_says_why() -> None:
    # max_cpu near zero: every step counts as a client out of CPU (the rule's path end to end)
    got = asyncio.run(
        measure_ceiling(REQUESTS, workers=2, start_rate=50, max_cpu=1e-9, budget_s=1.5)
    )
    assert got.ceiling_rps is None and not got.at_least
    assert got.limit is not None and "client CPU" in got.limit
    assert got.workers == 2 and len(got.cpus) == 2
    assert all(s.requests >= 20 and s.client_cpu_s > 0 for s in got.steps)
