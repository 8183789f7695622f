"""Tests of jobs.load.loadpool: the load generator over several processes gives what one process
gives.

The server is :class:`jobs.stub.stubserver.StubServer` with known timing (TTFT 20 ms, 5 ms
between tokens, 6 tokens: E2EL 45 ms), in its own process. One pool of two workers is
started for the module and reused by every test (as the capacity runner reuses one for
its steps); a one-process run of the same list is the reference.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from jobs.load.loadgen import run_load, summarize
from jobs.load.loadpool import LoadPool, LoadResult, run_load_workers
from jobs.load.workerplan import assign, cores_off_engine, engine_cpus, worker_cpus
from jobs.schemas import ChatRequest, RequestRecord
from jobs.stub.stubserver import StubServer

TTFT, ITL, TOKENS = 0.02, 0.005, 6
E2EL = TTFT + (TOKENS - 1) * ITL
#: how far above the configured timing a median may be: 2 workers, the caller and the stub
#: share a loaded 2-core machine
SLACK = 0.03


def _req(i: int, **fields: Any) -> ChatRequest:
    return ChatRequest(
        index=i,
        messages=[{"role": "user", "content": f"question {i}"}],
        max_tokens=fields.pop("max_tokens", TOKENS),
        **fields,
    )


@pytest.fixture(scope="module")
def stub() -> Iterator[StubServer]:
    with StubServer(TTFT, ITL, process=True) as server:
        yield server


@pytest.fixture(scope="module")
def pool() -> Iterator[LoadPool]:
    with LoadPool(2) as started:
        yield started


def _run(pool: LoadPool, stub: StubServer, requests: list[ChatRequest], **kw: Any) -> LoadResult:
    return asyncio.run(pool.run(stub.base_url, "m", requests, **kw))


def _timing_ok(records: list[RequestRecord]) -> None:
    ok = [r for r in records if r.success]
    ttft = statistics.median(r.ttft_s or 0.0 for r in ok)
    e2el = statistics.median(r.e2el_s or 0.0 for r in ok)
    assert TTFT <= ttft <= TTFT + SLACK, ttft
    assert E2EL <= e2el <= E2EL + SLACK, e2el


def _shape(records: list[RequestRecord]) -> list[tuple[Any, ...]]:
    """What must be equal between a pool run and a one-process run (not the timing)."""
    return [
        (r.index, r.warmup, r.success, r.output_tokens, r.prompt_tokens, r.conversation, r.turn)
        for r in records
    ]


# ------------------------------------------------------------------------- assignment


def test_assign_keeps_conversations_together_and_deals_the_rest_round_robin() -> None:
    # 3 conversations of 2 turns (turn-major), then 4 independent requests
    conv = [
        _req(3 * t + c, after=None if t == 0 else c, conversation=c)
        for t in range(2)
        for c in range(3)
    ]
    loose = [_req(10 + i) for i in range(4)]
    shares = assign([*conv, *loose], workers=2, concurrency=8)
    assert [slots for _, slots in shares] == [4, 4]
    where = {p: w for w, (positions, _) in enumerate(shares) for p in positions}
    for c in range(3):  # turn 0 at position c, turn 1 at 3 + c: one worker
        assert where[c] == where[3 + c]
    assert sorted(where) == list(range(10))
    for positions, _ in shares:
        assert positions == sorted(positions)
    assert abs(len(shares[0][0]) - len(shares[1][0])) <= 2


def test_assign_splits_the_cap_and_never_uses_more_workers_than_slots_or_groups() -> None:
    reqs = [_req(i) for i in range(9)]
    assert [s for _, s in assign(reqs, workers=2, concurrency=3)] == [2, 1]
    # twice as many slots: twice as many requests (a closed loop's share)
    assert [len(p) for p, _ in assign(reqs, workers=2, concurrency=3)] == [6, 3]
    assert len(assign(reqs, workers=4, concurrency=2)) == 2
    chain = [_req(0), *(_req(i, after=i - 1) for i in range(1, 5))]
    assert assign(chain, workers=3, concurrency=9) == [([0, 1, 2, 3, 4], 9)]
    # a dependency on a later request joins that request's group too
    assert assign([_req(0, after=1), _req(1)], workers=2, concurrency=2) == [([0, 1], 2)]


def test_worker_cpus_avoid_the_engines_cores() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert worker_cpus(2, None) == [None, None]
    cpus = worker_cpus(3, allowed[:1])
    assert all(c and allowed[0] not in c for c in cpus)
    with pytest.raises(ValueError, match="no core left"):
        worker_cpus(1, allowed)


# --------------------------------------------------------------------- against the stub


@pytest.mark.timing  # medians within SLACK of the stub's timing: alone on the machine
def test_open_loop_over_two_workers_matches_one_process(pool: LoadPool, stub: StubServer) -> None:
    gap, n = 0.01, 60  # 100 req/s for 0.6 s
    reqs = [_req(i, arrival_s=i * gap) for i in range(n)]
    origin = time.perf_counter()
    one = asyncio.run(run_load(stub.base_url, "m", reqs, concurrency=n, clock_origin=origin))
    origin = time.perf_counter()
    got = _run(pool, stub, reqs, concurrency=n, clock_origin=origin)
    assert _shape(got.records) == _shape(one)
    assert [r.index for r in got.records] == list(range(n))
    # one shared schedule: due times exactly arrival_s apart whichever worker sent them
    scheduled = [r.scheduled_s for r in got.records]
    assert all(s is not None for s in scheduled)
    offsets = [s - scheduled[0] for s in scheduled]  # type: ignore[operator]
    assert offsets == pytest.approx([i * gap for i in range(n)], abs=1e-9)
    assert 0.0 < scheduled[0] < 2.0  # type: ignore[operator]  # on the caller's origin
    lags = sorted(r.start_s - r.scheduled_s for r in got.records)  # type: ignore[operator]
    assert lags[0] >= 0.0 and lags[n // 2] < 0.02
    _timing_ok(got.records)
    _timing_ok(one)
    a, b = summarize(got.records, 1.0), summarize(one, 1.0)
    assert a["completed"] == b["completed"] == n
    for key in ("median_ttft_ms", "median_e2el_ms", "median_itl_ms"):
        assert abs(a[key] - b[key]) < SLACK * 1000, (key, a[key], b[key])
    # per-worker reports: both used, their requests add up, CPU and lag measured
    assert [w.worker for w in got.workers] == [0, 1]
    assert sum(w.requests for w in got.workers) == n
    assert len({w.pid for w in got.workers} | {os.getpid()}) == 3
    assert all(w.cpu_s > 0 and w.dispatch_lag_p99_ms is not None for w in got.workers)
    assert got.client_cpu_s >= sum(w.cpu_s for w in got.workers) > 0
    assert got.cpu_per_request_ms() == pytest.approx(got.client_cpu_s * 1000 / n)


@pytest.mark.timing  # medians within SLACK of the stub's timing: alone on the machine
def test_closed_loop_conversations_and_warmups(pool: LoadPool, stub: StubServer) -> None:
    # 2 warm-ups, then 4 conversations of 3 turns (turn-major), concurrency 4
    warm = [_req(-2 + i, warmup=True) for i in range(2)]
    turns = [
        _req(4 * t + c, conversation=c, turn=t, after=None if t == 0 else 4 * (t - 1) + c)
        for t in range(3)
        for c in range(4)
    ]
    reqs = [*warm, *turns]
    one = asyncio.run(run_load(stub.base_url, "m", reqs, concurrency=4))
    seen: list[int] = []
    stub.reset_stats()
    got = _run(pool, stub, reqs, concurrency=4, on_record=lambda r: seen.append(r.index))
    assert _shape(got.records) == _shape(one)
    assert sorted(seen) == sorted(r.index for r in reqs)
    by_index = {r.index: r for r in got.records}
    for r in turns:
        if r.after is not None:  # each turn after the previous one ended
            prev = by_index[r.after]
            assert by_index[r.index].start_s >= prev.start_s + (prev.e2el_s or 0.0)
    assert max(r.start_s for r in got.records[:2]) < min(r.start_s for r in got.records[2:])
    assert stub.stats()["max_running"] <= 4
    _timing_ok(got.records)


def test_duration_cancel_and_stop_when(pool: LoadPool, stub: StubServer) -> None:
    reqs = [_req(i, arrival_s=i * 0.02) for i in range(100)]  # 2 s of arrivals
    got = _run(pool, stub, reqs, concurrency=100, duration_s=0.3)
    starts = [r.start_s for r in got.records]
    assert 10 <= len(got.records) <= 18  # 16 due in the first 0.3 s
    assert max(starts) - min(starts) <= 0.3 + 0.005
    assert [r.index for r in got.records] == list(range(len(got.records)))

    cancel = threading.Event()
    t0 = time.perf_counter()
    got = _run(pool, stub, reqs, concurrency=100, cancel=cancel, on_record=lambda _: cancel.set())
    assert time.perf_counter() - t0 < 1.5 and 1 <= len(got.records) < 60

    t0 = time.perf_counter()
    got = _run(pool, stub, reqs, concurrency=100, stop_when=lambda r: r.index >= 5)
    assert time.perf_counter() - t0 < 1.5 and 6 <= len(got.records) < 60
    # the pool still serves a full load after stops
    again = _run(pool, stub, reqs[:10], concurrency=10)
    assert len(again.records) == 10 and all(r.success for r in again.records)


def test_pinned_workers_run_off_the_avoided_cores(stub: StubServer) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two cores")
    reqs = [_req(i, arrival_s=i * 0.01) for i in range(20)]
    got = asyncio.run(
        run_load_workers(
            stub.base_url, "m", reqs, concurrency=20, workers=2, avoid_cpus=allowed[:1]
        )
    )
    assert not got.in_process and len(got.records) == 20
    assert all(allowed[0] not in w.cpus for w in got.workers)


def test_one_worker_in_process_reports_this_process(stub: StubServer) -> None:
    reqs = [_req(i) for i in range(8)]
    got = asyncio.run(run_load_workers(stub.base_url, "m", reqs, concurrency=2))
    assert got.in_process and got.workers[0].pid == os.getpid()
    assert len(got.records) == 8 and got.client_cpu_s > 0
    with pytest.raises(ValueError):
        asyncio.run(run_load_workers(stub.base_url, "m", reqs, concurrency=0))


def test_a_worker_that_dies_fails_the_load(stub: StubServer) -> None:
    reqs = [_req(i, arrival_s=i * 0.02) for i in range(50)]
    with LoadPool(2) as doomed:
        victim = doomed._procs[1].pid
        timer = threading.Timer(0.3, os.kill, (victim, signal.SIGKILL))
        timer.start()
        try:
            with pytest.raises(RuntimeError, match="load worker 1 exited"):
                asyncio.run(doomed.run(stub.base_url, "m", reqs, concurrency=50))
        finally:
            timer.cancel()
        with pytest.raises(RuntimeError, match="load worker 1 has exited"):
            asyncio.run(doomed.run(stub.base_url, "m", reqs, concurrency=50))


def test_repeated_indexes_and_an_unstarted_pool_are_refused(
    pool: LoadPool, stub: StubServer
) -> None:
    with pytest.raises(ValueError, match="unique"):
        _run(pool, stub, [_req(0), _req(0)], concurrency=1)
    with pytest.raises(RuntimeError, match="not started"):
        asyncio.run(LoadPool(1).run(stub.base_url, "m", [_req(0)], concurrency=1))


def test_the_engines_cores_are_read_from_its_cpu_binding() -> None:
    assert engine_cpus("0-3") == {0, 1, 2, 3}
    assert engine_cpus("0-1|4-5") == {0, 1, 4, 5}  # one list per rank
    assert engine_cpus("0,2,5-6") == {0, 2, 5, 6}
    for unknown in (None, "", "auto", "all", "nobind", "3-1", "0-x", "-1"):
        assert engine_cpus(unknown) is None, unknown
    mine = sorted(os.sched_getaffinity(0))
    everything = f"0-{max(mine)}"
    assert cores_off_engine(everything) is None  # no core left: not pinned
    assert cores_off_engine("auto") is None
    if len(mine) > 1:  # the engine on one core: the load generator avoids it
        assert cores_off_engine(str(mine[0])) == {mine[0]}
