"""The load generator's own stalls (:mod:`jobs.load.stalls`): a loop that cannot run is
seen as a stall on the records' clock, and the stall numbers say which requests it may
have moved (issue: a supervisor SIGSTOPped for 11 s gave a clean ``succeeded`` run with
one TTFT of 11.09 s and its throughput understated by a third, and nothing said so)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from jobs.load.stalls import STALL_S, STALL_SHARE, TICK_S, LoopWatch, stall_metrics
from jobs.run.runner import execute_batch
from jobs.schemas import Progress, RequestRecord
from orchestrator.analysis.trust import run_trust
from tests.jobs.test_runner_batch import _batch, _fake_engine, _workload


def _rec(
    start: float, e2el: float | None, ttft: float | None = None, **kw: object
) -> RequestRecord:
    return RequestRecord(
        index=0,
        success=e2el is not None,
        start_s=start,
        e2el_s=e2el,
        ttft_s=ttft,
        **kw,  # type: ignore[arg-type]
    )


def test_a_blocked_loop_is_one_stall_on_the_records_clock() -> None:
    async def main() -> tuple[LoopWatch, float, float]:
        origin = time.perf_counter() - 100.0  # the records' clock: 100 s into the run
        watch = LoopWatch(origin)
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(0.12)  # a few ticks first
        blocked_from = time.perf_counter() - origin
        time.sleep(0.4)  # the loop cannot run (as a stopped or starved process)
        blocked_to = time.perf_counter() - origin
        await asyncio.sleep(0.12)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return watch, blocked_from, blocked_to

    watch, blocked_from, blocked_to = asyncio.run(main())
    covering = [(a, b) for a, b in watch.stalls if a <= blocked_from + 0.06 and b >= blocked_to]
    assert len(covering) == 1, watch.stalls
    (a, b) = covering[0]
    assert b - a >= 0.4 - watch.tick_s and 100.0 < a < b
    assert all(b - a >= STALL_S for a, b in watch.stalls)


def test_stall_numbers_count_only_requests_a_stall_may_have_moved() -> None:
    stalls = [(10.0, 10.5)]  # 0.5 s
    long_request = _rec(5.0, e2el=8.0, ttft=4.0)  # 0.5 s is 6 % of its 8 s, after its TTFT
    short_request = _rec(9.8, e2el=1.0, ttft=0.5)  # 50 % of its E2EL
    ttft_hit = _rec(9.0, e2el=20.0, ttft=2.0)  # 2.5 % of E2EL, 25 % of its TTFT window
    before = _rec(1.0, e2el=2.0, ttft=0.5)  # ended before the stall
    due_in_stall = _rec(10.6, e2el=1.0, ttft=0.2, scheduled_s=10.2)  # open loop, sent late
    failed = _rec(10.1, e2el=None)  # no latency to move, counted among the measured
    warmup = _rec(10.1, e2el=0.5, warmup=True)  # not measured
    got = stall_metrics(
        stalls, [long_request, short_request, ttft_hit, before, due_in_stall, failed, warmup]
    )
    assert got["client_stall_s"] == pytest.approx(0.5)
    assert got["max_client_stall_ms"] == pytest.approx(500.0)
    # short_request, ttft_hit and due_in_stall of 6 measured
    assert got["client_stalled_request_fraction"] == pytest.approx(3 / 6)
    assert STALL_SHARE == 0.1  # the 6 % / 25 % cases above sit either side of it
    clean = stall_metrics([], [long_request, short_request])
    assert clean == {
        "client_stall_s": 0.0,
        "max_client_stall_ms": 0.0,
        "client_stalled_request_fraction": 0.0,
    }
    assert stall_metrics(stalls, [warmup]) == {}


def test_a_run_whose_client_stalls_says_so_and_gives_no_verdict(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Through the runner on a fake engine (8 tokens, 5 ms apart): the progress report of
    the third measured request blocks the runner's event loop for 0.6 s, as a stopped or
    starved supervisor would; the request in flight beside it is moved by far more than a
    tenth of its E2EL. The run still succeeds (what was measured is kept) but its stall
    numbers say so and no comparison takes a verdict from it."""
    blocked: list[float] = []

    def progress(p: Progress) -> None:
        if p.phase == "measuring" and p.requests_done == 3 and not blocked:
            blocked.append(0.6)
            time.sleep(0.6)  # the fault: the loop that times the requests cannot run

    job = _batch(
        tmp_path,
        tiny_model_dir,
        _fake_engine(tmp_path, None),
        [_workload(num_requests=10, concurrency=2)],
    )
    (result,) = execute_batch(job, progress=progress)
    assert result.status == "succeeded", result.error
    assert blocked == [0.6]
    m = result.metrics
    assert m["client_stall_s"] >= 0.6 - 2 * TICK_S
    assert m["max_client_stall_ms"] >= (0.6 - 2 * TICK_S) * 1000.0
    assert m["client_stalled_request_fraction"] >= 0.1  # the one beside it, of 10
    trust = run_trust(result.run_id, m)
    assert "client_stalled" in trust.flags
    assert trust.reason("median_ttft_ms") and trust.reason("request_throughput")
