"""The load generator's ceiling where it runs: the highest open-loop rate it sustains.

A capacity step asks the load generator for a rate; if the client cannot send that
fast, the server sees less, and a "pass" says nothing about the rate asked for.
:func:`measure_ceiling` measures, on this node and for this request list, the highest
constant request rate the load generator (``workers`` processes, pinned as the steps
will be) sustains against :class:`jobs.stub.stubserver.StubServer`, a server that answers at
once (TTFT and ITL ~1 ms by default, the requests' own output lengths), started in a
subprocess for the calibration (on ``avoid_cpus``, the engine's idle cores, when given).

The ramp: steps of ``step_s`` seconds (and at least ``min_step_requests`` requests) at
``start_rate``, then ``growth`` times faster, until a step is not sustained, the rate
passes ``max_rate`` or the time budget ends; then the bracket between the last
sustained rate and the first failing one is halved (geometrically) while time is left.
A rate that fails is measured once more (``retries``) and counts as sustained if that
passes: a stall of a shared machine fails one short step, a client that cannot keep up
fails both. Every measurement is kept in ``steps``.
A step is **sustained** (:func:`judge_step`) when all of these hold:

- every request succeeded;
- the arrived rate (requests actually sent per second, from their ``start_s``) is at
  least ``min_arrived_fraction`` (95 %) of the asked rate (from their due times);
- the dispatch lag p99 (``start_s - scheduled_s``; slots never bind: the cap is the
  step's request count) is at most ``max_lag_p99_ms``;
- no load-generator process needed more than ``max_cpu`` of a core: its CPU seconds
  for the step over the step's seconds of arrivals. A short step can look sustained
  while its responses are parsed after its last arrival; a process that needs more
  than a core per second of arrivals cannot keep that up;
- the load generator and the stub together needed less than ``max_cpu`` of the cores
  they may run on (a short step can borrow cores that a steady load would not have).

The ceiling is the highest sustained rate; ``at_least`` says none failed (the ramp
stopped at ``max_rate`` or the budget), so the true ceiling is higher. Each step keeps
its evidence: arrived/asked, lag, CPU per request, and the stub's own CPU (when the
stub, not the client, runs out of CPU, ``limit`` says so: the client's ceiling is then
at least the figure).

Rates are constant (evenly spaced arrivals): a Poisson schedule of the same mean rate
bunches arrivals, so its ceiling is somewhat lower. ``after`` dependencies are dropped
(each request is sent on its own): the ceiling is about sending, not conversations.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from jobs.load.loadpool import LoadPool, LoadResult, run_load_workers
from jobs.schemas import ChatRequest, RequestRecord
from jobs.stub.stubserver import StubServer

__all__ = ["CeilingStep", "ClientCeiling", "arrival_rates", "judge_step", "measure_ceiling"]

_CLK_TCK = os.sysconf("SC_CLK_TCK")


class CeilingStep(BaseModel):
    """One rate of the ramp and its evidence."""

    asked_rate: float = Field(description="req/s the schedule asked for")
    arrived_rate: float | None = Field(description="req/s actually sent (from start_s)")
    requests: int
    failed: int
    dispatch_lag_p99_ms: float | None
    client_cpu_s: float = Field(description="CPU seconds of every load-generator process")
    busiest_cpu: float = Field(
        description="highest CPU seconds of one process per second of arrivals (n / rate)"
    )
    cpu_per_request_ms: float | None
    stub_cpu: float | None = Field(
        None, description="the stub's CPU seconds per second of arrivals"
    )
    node_cpu: float | None = Field(
        None, description="load generator and stub together, CPU seconds per second of arrivals"
    )
    wall_s: float
    sustained: bool
    limits: list[str] = Field(default_factory=list, description="why it was not sustained")


class ClientCeiling(BaseModel):
    """The load generator's ceiling for one workload on one node (:func:`measure_ceiling`)."""

    ceiling_rps: float | None = Field(
        description="highest sustained rate, req/s; None: not even the lowest rate tried"
    )
    failed_rps: float | None = Field(
        None, description="lowest rate that failed every measurement, req/s; None: none did"
    )
    at_least: bool = Field(description="no rate failed: the true ceiling is higher")
    limit: str | None = Field(description="what failed at the lowest failing rate")
    stub_limited: bool = Field(
        False, description="the stub ran out of CPU at that rate: the client may go higher"
    )
    workers: int
    cpus: list[list[int]] = Field(description="the cores each load-generator process used")
    stub_ttft_s: float
    stub_itl_s: float
    elapsed_s: float
    steps: list[CeilingStep]

    def at_ceiling(self) -> CeilingStep | None:
        """The step of the ceiling (the highest sustained rate), if any."""
        ok = [s for s in self.steps if s.sustained]
        return max(ok, key=lambda s: s.asked_rate) if ok else None


def arrival_rates(records: Sequence[RequestRecord]) -> tuple[float | None, float | None]:
    """Asked and arrived rates (req/s) of the measured open-loop records.

    Asked: ``(n - 1) / (last - first due time)``; arrived: ``(n - 1) / (last - first
    start_s)``, over the records with a ``scheduled_s``; (None, None) with fewer than
    two or a zero span.
    """
    timed = [r for r in records if r.scheduled_s is not None and not r.warmup]
    if len(timed) < 2:
        return None, None
    due = [r.scheduled_s for r in timed if r.scheduled_s is not None]
    starts = [r.start_s for r in timed]
    asked_span, arrived_span = max(due) - min(due), max(starts) - min(starts)
    n = len(timed) - 1
    return (n / asked_span if asked_span > 0 else None), (
        n / arrived_span if arrived_span > 0 else None
    )


def judge_step(
    asked: float,
    arrived: float | None,
    failed: int,
    requests: int,
    lag_p99_ms: float | None,
    busiest_cpu: float,
    *,
    min_arrived_fraction: float = 0.95,
    max_lag_p99_ms: float = 25.0,
    max_cpu: float = 0.9,
    node_cpu: float | None = None,
    cores: int | None = None,
) -> list[str]:
    """Why a step was not sustained (module docstring); [] when it was.

    ``busiest_cpu``: the busiest load-generator process's CPU seconds per second of
    arrivals; ``node_cpu``: all of them and the stub together, on ``cores`` cores.
    """
    limits: list[str] = []
    if failed:
        limits.append(f"{failed} of {requests} requests failed")
    if arrived is None or arrived < min_arrived_fraction * asked:
        got = "unknown" if arrived is None else f"{arrived:.1f} req/s ({arrived / asked:.0%})"
        limits.append(f"arrived {got} of {asked:.1f} asked")
    if lag_p99_ms is not None and lag_p99_ms > max_lag_p99_ms:
        limits.append(f"dispatch lag p99 {lag_p99_ms:.1f} ms > {max_lag_p99_ms:g} ms")
    if busiest_cpu >= max_cpu:
        limits.append(f"client CPU {busiest_cpu:.0%} of a core per second of arrivals")
    if node_cpu is not None and cores and node_cpu >= max_cpu * cores:
        limits.append(
            f"client and stub need {node_cpu:.2f} cores per second of arrivals, {cores} there"
        )
    return limits


def _proc_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) of process ``pid`` from ``/proc``; None if unreadable."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime


def _schedule(requests: Sequence[ChatRequest], rate: float, n: int) -> list[ChatRequest]:
    """``n`` requests cycled from ``requests`` (measured ones, else all), due ``i / rate``."""
    pool = [r for r in requests if not r.warmup] or list(requests)
    return [
        pool[i % len(pool)].model_copy(
            update={
                "index": i,
                "arrival_s": i / rate,
                "after": None,
                "warmup": False,
                "conversation": None,
                "turn": None,
            }
        )
        for i in range(n)
    ]


async def measure_ceiling(
    requests: Sequence[ChatRequest],
    *,
    workers: int = 1,
    avoid_cpus: Collection[int] | None = None,
    pool: LoadPool | None = None,
    start_rate: float = 50.0,
    max_rate: float = 20_000.0,
    growth: float = 1.6,
    step_s: float = 0.5,
    min_step_requests: int = 20,
    budget_s: float = 6.0,
    min_arrived_fraction: float = 0.95,
    max_lag_p99_ms: float = 25.0,
    max_cpu: float = 0.9,
    refine: float = 1.15,
    retries: int = 1,
    stub_ttft_s: float = 0.001,
    stub_itl_s: float = 0.001,
    timeout_s: float = 30.0,
) -> ClientCeiling:
    """The highest open-loop rate the load generator sustains for ``requests`` here.

    Args:
        requests: the workload's request list (warm-ups are skipped; prompts and
            ``max_tokens`` are kept, so body sizes and output lengths are the run's).
        workers: load-generator processes (:mod:`jobs.load.loadpool`); 1 without
            ``avoid_cpus`` runs in this process, as :func:`jobs.load.loadpool.run_load_workers`.
        avoid_cpus: the engine's cores: the workers run on the others, the stub on these.
        pool: a started :class:`~jobs.load.loadpool.LoadPool` to use (then ``workers`` and
            ``avoid_cpus`` are the pool's business).
        start_rate, max_rate, growth: the ramp (req/s, and the factor between steps).
        step_s, min_step_requests: a step's length (seconds of arrivals) and floor.
        budget_s: seconds of ramp at most (the pool's and the stub's start excluded).
        min_arrived_fraction, max_lag_p99_ms, max_cpu: the rules of :func:`judge_step`.
        refine: halve the bracket while the failing rate / the sustained one exceeds it.
        retries: measurements more of a rate that failed (a stall of a busy machine
            fails one short step; a client that cannot keep up fails every one).
        stub_ttft_s, stub_itl_s: the stub's timing (near zero: the client's limit alone).
        timeout_s: per request.

    Raises:
        ValueError: an empty request list, or a rate, growth or budget out of range.
    """
    if not requests:
        raise ValueError("measure_ceiling needs at least one request")
    if not (0 < start_rate <= max_rate and growth > 1 and budget_s > 0 and refine > 1):
        raise ValueError("need 0 < start_rate <= max_rate, growth > 1, refine > 1, budget_s > 0")
    t_call = time.perf_counter()
    async with _started(pool, workers, avoid_cpus, stub_ttft_s, stub_itl_s) as (stub, pool):
        ramp = _Ramp(
            stub,
            pool,
            requests,
            cores=_cores(pool, stub.pid),
            deadline=time.perf_counter() + budget_s,
            step_s=step_s,
            min_step_requests=min_step_requests,
            retries=retries,
            timeout_s=timeout_s,
            rules=(min_arrived_fraction, max_lag_p99_ms, max_cpu),
        )
        ok, bad = await _search(ramp.step, start_rate, max_rate, growth, refine)
        steps = ramp.steps
        # the last measurement at the lowest rate that failed every time
        lowest_fail = next((s for s in reversed(steps) if s.asked_rate == bad), None)
        cpus = pool.cpus if pool is not None else [sorted(os.sched_getaffinity(0))]
        return ClientCeiling(
            ceiling_rps=ok,
            failed_rps=bad,
            at_least=bad is None,
            limit="; ".join(lowest_fail.limits) if lowest_fail is not None else None,
            stub_limited=lowest_fail is not None and _stub_busy(lowest_fail, max_cpu),
            workers=len(cpus),
            cpus=cpus,
            stub_ttft_s=stub_ttft_s,
            stub_itl_s=stub_itl_s,
            elapsed_s=time.perf_counter() - t_call,
            steps=steps,
        )


@contextlib.asynccontextmanager
async def _started(
    pool: LoadPool | None,
    workers: int,
    avoid_cpus: Collection[int] | None,
    stub_ttft_s: float,
    stub_itl_s: float,
) -> AsyncIterator[tuple[StubServer, LoadPool | None]]:
    """The stub (on ``avoid_cpus``, the engine's cores) and the pool to use, started;
    stopped on the way out (a ``pool`` given is the caller's to close)."""
    stub = StubServer(stub_ttft_s, stub_itl_s, process=True)
    own_pool: LoadPool | None = None
    if pool is None and (workers > 1 or avoid_cpus is not None):
        own_pool = pool = LoadPool(workers, avoid_cpus=avoid_cpus)
    try:
        await asyncio.to_thread(stub.start)
        if avoid_cpus and stub.pid is not None:
            with contextlib.suppress(OSError):  # an engine core outside our own set
                os.sched_setaffinity(stub.pid, avoid_cpus)
        if own_pool is not None:
            await asyncio.to_thread(own_pool.start)
        yield stub, pool
    finally:
        if own_pool is not None:
            await asyncio.to_thread(own_pool.close)
        await asyncio.to_thread(stub.stop)


@dataclass
class _Ramp:
    """:func:`measure_ceiling`'s steps against one stub, within one time budget."""

    stub: StubServer
    pool: LoadPool | None
    requests: Sequence[ChatRequest]
    cores: int
    deadline: float
    step_s: float
    min_step_requests: int
    retries: int
    timeout_s: float
    rules: tuple[float, float, float]  # min_arrived_fraction, max_lag_p99_ms, max_cpu
    steps: list[CeilingStep] = field(default_factory=list)

    async def step(self, rate: float) -> CeilingStep | None:
        """Measure ``rate`` (again after a failure, ``retries`` times); the last
        measurement, sustained if any was. None: no time left for all of them."""
        n = max(self.min_step_requests, math.ceil(rate * self.step_s))
        need_s = (1 + self.retries) * (n / rate + 0.2)
        if time.perf_counter() + need_s > self.deadline and self.steps:
            return None  # no time left for every measurement it may need
        last: CeilingStep | None = None
        for _ in range(1 + self.retries):
            got = await _run_step(self.stub, self.pool, self.requests, rate, n, self.timeout_s)
            last = _evidence(got, rate, n, self.cores, *self.rules)
            self.steps.append(last)
            if last.sustained:
                break
        return last


async def _search(
    step: Callable[[float], Awaitable[CeilingStep | None]],
    start_rate: float,
    max_rate: float,
    growth: float,
    refine: float,
) -> tuple[float | None, float | None]:
    """The highest sustained rate and the lowest failing one that ``step`` found: a ramp
    up by ``growth`` from ``start_rate``, down when that failed, then the bracket halved
    (geometrically) while failing / sustained exceeds ``refine``; until ``step`` says
    the time is up (None)."""
    ok: float | None = None  # highest sustained rate
    bad: float | None = None  # lowest failing rate
    rate = start_rate
    while (s := await step(rate)) is not None:  # ramp up
        if not s.sustained:
            bad = rate
            break
        ok = rate
        if rate >= max_rate:
            break
        rate = min(rate * growth, max_rate)
    while ok is None and bad is not None:  # the first rate failed: ramp down
        rate = bad / growth
        if (s := await step(rate)) is None:
            break
        if s.sustained:
            ok = rate
        else:
            bad = rate
    while ok is not None and bad is not None and bad / ok > refine:
        mid = math.sqrt(ok * bad)
        s = await step(mid)
        if s is None:
            break
        if s.sustained:
            ok = mid
        else:
            bad = mid
    return ok, bad


async def _run_step(
    stub: StubServer,
    pool: LoadPool | None,
    requests: Sequence[ChatRequest],
    rate: float,
    n: int,
    timeout_s: float,
) -> tuple[LoadResult, float | None, float]:
    """One constant-rate load against the stub: the result, the stub's CPU seconds, wall."""
    reqs = _schedule(requests, rate, n)
    stub_cpu0, t0 = _proc_cpu_s(stub.pid), time.perf_counter()
    if pool is not None:
        got = await pool.run(stub.base_url, "ceiling", reqs, concurrency=n, timeout_s=timeout_s)
    else:
        got = await run_load_workers(
            stub.base_url, "ceiling", reqs, concurrency=n, timeout_s=timeout_s
        )
    wall = time.perf_counter() - t0
    stub_cpu1 = _proc_cpu_s(stub.pid)
    stub_cpu = None if stub_cpu0 is None or stub_cpu1 is None else stub_cpu1 - stub_cpu0
    return got, stub_cpu, wall


def _evidence(
    run: tuple[LoadResult, float | None, float],
    rate: float,
    n: int,
    cores: int,
    min_arrived_fraction: float,
    max_lag_p99_ms: float,
    max_cpu: float,
) -> CeilingStep:
    got, stub_cpu_s, wall = run
    asked = rate  # the schedule's (due times i / rate)
    arrived = arrival_rates(got.records)[1]
    failed = sum(not r.success for r in got.records) + (n - len(got.records))
    lags = [w.dispatch_lag_p99_ms for w in got.workers if w.dispatch_lag_p99_ms is not None]
    lag = max(lags) if lags else None
    # CPU per second of arrivals, not of wall time: a short step's responses can be parsed
    # after its last arrival (the kernel buffers them), so a process that needs more than
    # a core per second of arrivals keeps up for a step and falls behind in steady state
    per_s = rate / n  # 1 / seconds of arrivals
    busiest = max((w.cpu_s for w in got.workers), default=0.0) * per_s
    stub_cpu = stub_cpu_s * per_s if stub_cpu_s is not None else None
    node_cpu = (got.client_cpu_s + stub_cpu_s) * per_s if stub_cpu_s is not None else None
    limits = judge_step(
        asked,
        arrived,
        failed,
        n,
        lag,
        busiest,
        min_arrived_fraction=min_arrived_fraction,
        max_lag_p99_ms=max_lag_p99_ms,
        max_cpu=max_cpu,
        node_cpu=node_cpu,
        cores=cores,
    )
    step = CeilingStep(
        asked_rate=asked,
        arrived_rate=arrived,
        requests=n,
        failed=failed,
        dispatch_lag_p99_ms=lag,
        client_cpu_s=got.client_cpu_s,
        busiest_cpu=busiest,
        cpu_per_request_ms=got.cpu_per_request_ms(),
        stub_cpu=stub_cpu,
        node_cpu=node_cpu,
        wall_s=wall,
        sustained=not limits,
        limits=limits,
    )
    if limits and _stub_busy(step, max_cpu):
        step.limits.append(
            f"the stub needed {stub_cpu:.0%} of a core per second of arrivals: "
            "the client may go higher"
        )
    return step


def _cores(pool: LoadPool | None, stub_pid: int | None) -> int:
    """How many cores the load generator's processes and the stub may run on together."""
    cpus = {c for w in (pool.cpus if pool is not None else []) for c in w}
    if pool is None:
        cpus |= os.sched_getaffinity(0)
    if stub_pid is not None:
        with contextlib.suppress(OSError):
            cpus |= os.sched_getaffinity(stub_pid)
    return len(cpus)


def _stub_busy(step: CeilingStep, max_cpu: float) -> bool:
    return step.stub_cpu is not None and step.stub_cpu >= max_cpu
