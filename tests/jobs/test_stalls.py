"""The load generator's own stalls (:mod:`jobs.load.stalls`): a loop that cannot run is
seen as a stall on the records' clock, and the stall numbers say which requests it may
have moved (issue: a supervisor SIGSTOPped for 11 s gave a clean ``succeeded`` run with
one TTFT of 11.09 s and its throughput understated by a third, and nothing said so)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from jobs.load.stalls import (
    STALL_S,
    STALL_SHARE,
    TICK_S,
    LoopWatch,
    stall_metrics,
    stall_reason,
)
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


def test_a_stall_moves_the_requests_it_timed_by_a_tenth_of_their_latency() -> None:
    """A request sent before a stall ``(a, b]`` ended is moved when its first token or
    last chunk was timed at its end (up to a tick after ``b``), the stall at least a tenth
    of its TTFT or E2EL long; a stall it was merely in flight through (its chunks timed
    later) or one that only delayed its start is not."""
    stalls = [(10.0, 10.5)]  # 0.5 s
    ended_in_it = _rec(9.8, e2el=0.6, ttft=0.1)  # last chunk timed at 10.4: 0.5 >= 0.06
    first_in_it = _rec(9.0, e2el=20.0, ttft=1.2)  # first token at 10.2: 0.5 >= 0.12
    through_it = _rec(5.0, e2el=8.0, ttft=4.0)  # first at 9.0, last at 13.0: not moved
    long_end = _rec(4.6, e2el=5.8, ttft=5.4)  # both in it, but 0.5 < a tenth of 5.8 / 5.4
    started_late = _rec(10.5, e2el=1.0, ttft=0.2, scheduled_s=10.1)  # open loop, sent late
    failed = _rec(10.1, e2el=None)  # no latency to move, counted among the measured
    warmup = _rec(9.9, e2el=0.5, warmup=True)  # not measured
    # timed just after the stall's end, as a trial timed every request in flight through a
    # 3 s stop (the backlog of reads after the loop's return): moved
    caught_up = _rec(9.9, e2el=0.602)  # last chunk timed at 10.502
    # sent once the loop ran again, its first token 10 ms later: its clock began after it
    sent_after = _rec(10.501, e2el=0.3, ttft=0.01)
    got = stall_metrics(
        stalls,
        [ended_in_it, first_in_it, through_it, long_end, started_late, failed, warmup]
        + [caught_up, sent_after],
    )
    assert got["client_stall_s"] == pytest.approx(0.5)
    assert got["max_client_stall_ms"] == pytest.approx(500.0)
    # ended_in_it, first_in_it and caught_up, of 8
    assert got["client_stalled_requests"] == 3
    assert got["client_stalled_request_fraction"] == pytest.approx(3 / 8)
    assert STALL_SHARE == 0.1
    clean = stall_metrics([], [ended_in_it, first_in_it])
    assert clean == {
        "client_stall_s": 0.0,
        "max_client_stall_ms": 0.0,
        "client_stalled_requests": 0.0,
        "client_stalled_request_fraction": 0.0,
    }
    assert stall_metrics(stalls, [warmup]) == {}


def test_the_rule_that_makes_stalls_matter() -> None:
    """Stalls matter when the loop lost a second or more in all and they took 5 % of the
    phase, or moved 5 % of the measured requests and two or more, or one of a second or
    more moved a request; a demo run's one 0.1 s hiccup that moved 1 of 16 requests does
    not, nor do a stub run's 0.9 s of hiccups that moved most of its few-ms requests."""
    assert stall_reason(0.2, 0.1, 1, 16, 14.75) is None  # the trial's demo run
    assert stall_reason(0.88, 0.225, 1, 60, 40.0) is None
    by_time = stall_reason(1.0, 0.2, 0, 60, 19.6)  # 5.1 % of the phase
    assert by_time is not None and "5.1% of the measured phase" in by_time
    assert stall_reason(0.99, 0.2, 0, 60, 2.0) is None  # half the phase, under a second
    assert stall_reason(1.0, 0.2, 2, 40, 60.0) is not None  # 5 % and two requests
    assert stall_reason(1.0, 0.2, 2, 41, 60.0) is None  # 4.9 %
    assert stall_reason(0.9, 0.3, 20, 24, 2.0) is None  # a stub run on a busy machine
    assert stall_reason(5.66, 5.02, 1, 60, 366.0) is not None  # a 5 s SIGSTOP, 1 moved
    assert stall_reason(5.66, 5.02, 0, 60, 366.0) is None  # it moved nothing
    text = str(stall_reason(5.66, 5.02, 1, 60, 366.0))
    assert "1.5% of the measured phase" in text and "1 of 60 measured requests (1.7%)" in text


def test_a_run_whose_client_stalls_says_so_and_gives_no_verdict(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Through the runner on a fake engine (8 tokens, 5 ms apart): the progress report of
    the third measured request blocks the runner's event loop for 1.2 s, as a stopped or
    starved supervisor would: half the measured phase or more. The run still succeeds
    (what was measured is kept) but its stall numbers say so and no comparison takes a
    verdict from it."""
    blocked: list[float] = []

    def progress(p: Progress) -> None:
        if p.phase == "measuring" and p.requests_done == 3 and not blocked:
            blocked.append(1.2)
            time.sleep(1.2)  # the fault: the loop that times the requests cannot run

    job = _batch(
        tmp_path,
        tiny_model_dir,
        _fake_engine(tmp_path, None),
        [_workload(num_requests=10, concurrency=2)],
    )
    (result,) = execute_batch(job, progress=progress)
    assert result.status == "succeeded", result.error
    assert blocked == [1.2]
    m = result.metrics
    assert m["client_stall_s"] >= 1.2 - 2 * TICK_S
    assert m["max_client_stall_ms"] >= (1.2 - 2 * TICK_S) * 1000.0
    # how many requests the stalls moved depends on the machine: the request in flight
    # beside the block (if it was still out), and on a loaded machine those that other
    # 0.1 s stalls moved (4 of 10 in one CI: the fake engine's requests last 40 ms)
    assert m["client_stalled_request_fraction"] == m["client_stalled_requests"] / 10
    trust = run_trust(result.run_id, m)
    assert "client_stalled" in trust.flags
    assert trust.reason("median_ttft_ms") and trust.reason("request_throughput")
