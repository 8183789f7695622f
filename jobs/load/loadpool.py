"""A load generator that scales out: :func:`jobs.load.loadgen.run_load` in several processes.

One Python process streams a few hundred requests/s at most (its event loop parses
every SSE chunk); past that, the dispatch lag grows and the load that arrives at the
server is less than the load asked for. :class:`LoadPool` runs the load in ``workers``
OS processes (:mod:`jobs.load.loadworker`, started with ``sys.executable``; no Ray: Ray actors
are the orchestrator's business) and gives one result, as if one process had run it:

- **one open-loop schedule.** Every worker counts its requests' ``arrival_s`` from the
  same ``time.perf_counter()`` value (``CLOCK_MONOTONIC``, shared by all processes of
  a Linux node), so a request is due at the same instant whichever worker sends it.
  Closed-loop workers start at that instant too.
- **order and dependencies.** Requests linked by ``after`` (a conversation's turns)
  stay in one worker, which sends them in list order as ``run_load`` does; groups
  are dealt to workers in list order, each to the worker with the fewest requests
  per slot (independent requests: round robin). Across workers each request still
  goes out at its own due time (open loop); a closed loop becomes ``workers``
  closed loops whose concurrencies add up to ``concurrency``.
- **the in-flight cap** is split: worker ``w`` gets ``concurrency // k`` slots (one
  more for the first ``concurrency % k``), ``k = min(workers, concurrency, groups)``
  workers being used. An open-loop cap that binds is then ``k`` caps of a share each.
- **one merged timeline**: records in request-list order, ``start_s``/``scheduled_s``
  offsets from the caller's ``clock_origin`` (one clock: no conversion).
- **per-worker reports** (:class:`~jobs.load.loadworker.WorkerReport`: requests, cores,
  CPU seconds, dispatch lag p99) and the total client CPU: the workers' CPU plus the
  threads of this process that receive their records.
- ``cancel``, ``stop_when`` and ``duration_s`` as in ``run_load``: a stop reaches the
  workers within ~0.1 s (records come in batches every 50 ms, a worker polls its stop
  every 50 ms); ``duration_s`` counts from the first measured request of the list, so
  a worker whose first request is due later stops at the same instant.
- **pinning** (``avoid_cpus``): the workers run on the node's cores other than those
  (the engine's), one core each while there are enough.

Deviations from one ``run_load`` call: leading warm-up requests are sent first by
worker 0 (closed loop, the whole ``concurrency``) and the measured phase starts when
they have finished (``run_load`` starts it once the last warm-up was sent); with more
than one worker, request indexes must be unique (records are matched by index).

:func:`run_load_workers` is the one-shot form (a drop-in for ``run_load``): with one
worker and no pinning it runs ``run_load`` in this process and reports this process's
CPU time (all its threads) as the client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from types import TracebackType
from typing import Any

from pydantic import BaseModel, Field

from jobs.load.loadgen import run_load
from jobs.load.loadworker import WorkerJob, WorkerReport, lag_stats_ms
from jobs.load.workerplan import assign, worker_cpus
from jobs.schemas import ChatRequest, RequestRecord

__all__ = [
    "LoadPool",
    "LoadResult",
    "WorkerReport",
    "run_load_workers",
]

logger = logging.getLogger(__name__)

#: the worker's entry (not ``-m``: its classes must pickle as ``jobs.load.loadworker.*``)
_WORKER_MAIN = "from jobs.load.loadworker import main; main()"
_START_MARGIN_S = 0.02  # from "go" to the shared start: the workers are armed and idle
_CANCEL_POLL_S = 0.05


class LoadResult(BaseModel):
    """The merged outcome of one load over one or more processes."""

    records: list[RequestRecord] = Field(description="request-list order, as run_load gives")
    workers: list[WorkerReport] = Field(description="one per worker that had requests")
    client_cpu_s: float = Field(description="CPU seconds of the load generator, all processes")
    relay_cpu_s: float = Field(0.0, description="part of it: this process receiving records")
    wall_s: float = Field(description="seconds from the call to its return")
    in_process: bool = Field(False, description="run_load ran in the calling process")

    def cpu_per_request_ms(self) -> float | None:
        """Client CPU milliseconds per record; None without records."""
        return self.client_cpu_s * 1000.0 / len(self.records) if self.records else None


def _check_args(concurrency: int, timeout_s: float, duration_s: float | None) -> None:
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a positive finite number, got {duration_s}")


def _thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds a live thread of this process has used (0 when it is gone)."""
    try:
        ident = thread.ident
        return time.clock_gettime(time.pthread_getcpuclockid(ident)) if ident else 0.0
    except OSError:
        return 0.0


@dataclass
class _Worker:
    number: int
    proc: subprocess.Popen[bytes]
    ctrl: Connection
    data: Connection
    pid: int = 0
    cpus: list[int] = field(default_factory=list)
    reader: threading.Thread | None = None


@dataclass
class _Phase:
    """One job over some workers: what the reader threads feed."""

    job: int
    loop: asyncio.AbstractEventLoop
    on_message: Callable[[int, tuple[Any, ...]], None]


class LoadPool:
    """``workers`` load-generator processes, started once and reused for many loads.

    Args:
        workers: processes (>= 1).
        avoid_cpus: cores the workers must not run on (the engine's); None: no pinning.
        start_timeout_s: how long a worker may take to start (import and say ready).

    Use as a context manager, or :meth:`start` / :meth:`close`; :meth:`run` runs one
    load at a time. ``start`` blocks (about a second per worker on a busy machine):
    from async code, ``await asyncio.to_thread(pool.start)``.

    Raises:
        ValueError: ``workers < 1``, or no core left outside ``avoid_cpus``.
    """

    def __init__(
        self,
        workers: int = 1,
        *,
        avoid_cpus: Collection[int] | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.avoid_cpus = None if avoid_cpus is None else sorted(avoid_cpus)
        self.start_timeout_s = start_timeout_s
        self._cpus = worker_cpus(workers, self.avoid_cpus)
        self._procs: list[_Worker] = []
        self._phase: _Phase | None = None
        self._lock = threading.Lock()
        self._jobs = 0

    @property
    def cpus(self) -> list[list[int]]:
        """The cores each started worker may run on."""
        return [w.cpus for w in self._procs]

    def start(self) -> LoadPool:
        """Start the worker processes; returns once each said it is ready.

        Raises:
            RuntimeError: already started, or a worker did not start in time.
        """
        if self._procs:
            raise RuntimeError("LoadPool is already started")
        root = str(Path(__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        try:
            for number, cpus in enumerate(self._cpus):
                self._procs.append(self._spawn(number, cpus, env))
            for worker in self._procs:
                self._await_ready(worker)
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, number: int, cpus: list[int] | None, env: dict[str, str]) -> _Worker:
        ctrl_r, ctrl_w = os.pipe()
        data_r, data_w = os.pipe()
        cmd = [sys.executable, "-c", _WORKER_MAIN, str(ctrl_r), str(data_w), str(number)]
        cmd.append(",".join(map(str, cpus)) if cpus else "")
        try:
            proc = subprocess.Popen(
                cmd, pass_fds=(ctrl_r, data_w), env=env, stdin=subprocess.DEVNULL
            )
        except BaseException:
            for fd in (ctrl_r, ctrl_w, data_r, data_w):
                os.close(fd)
            raise
        os.close(ctrl_r)
        os.close(data_w)
        ctrl = Connection(ctrl_w, readable=False)
        return _Worker(number, proc, ctrl, Connection(data_r, writable=False))

    def _await_ready(self, worker: _Worker) -> None:
        if not worker.data.poll(self.start_timeout_s):
            raise RuntimeError(
                f"load worker {worker.number} did not start within {self.start_timeout_s:g} s "
                f"(exit status {worker.proc.poll()})"
            )
        try:
            kind, pid, cpus = worker.data.recv()
        except EOFError:
            raise RuntimeError(
                f"load worker {worker.number} exited at start (status {worker.proc.wait()})"
            ) from None
        assert kind == "ready"
        worker.pid, worker.cpus = pid, cpus
        worker.reader = threading.Thread(
            target=self._read, args=(worker,), name=f"loadpool-{worker.number}", daemon=True
        )
        worker.reader.start()

    def _read(self, worker: _Worker) -> None:
        """Reader thread of one worker: hand each message to the phase running now."""
        while True:
            try:
                message: tuple[Any, ...] = worker.data.recv()
            except (EOFError, OSError):
                message = ("exited", None, f"status {worker.proc.wait()}")
            except Exception as exc:  # a message that does not unpickle: a bug
                message = ("exited", None, f"unreadable message: {exc!r}")
            with self._lock:
                phase = self._phase
            if phase is not None and (message[0] == "exited" or message[1] == phase.job):
                # a closed loop (RuntimeError): that run is over
                with contextlib.suppress(RuntimeError):
                    phase.loop.call_soon_threadsafe(phase.on_message, worker.number, message)
            if message[0] == "exited":
                return

    def close(self) -> None:
        """Stop the workers (a load in progress is abandoned); safe to call twice."""
        for worker in self._procs:
            with contextlib.suppress(OSError):
                worker.ctrl.send(("exit",))
        for worker in self._procs:
            try:
                worker.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
            worker.ctrl.close()
            if worker.reader is not None:
                worker.reader.join(timeout=5)
            worker.data.close()
        self._procs = []

    def __enter__(self) -> LoadPool:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def run(
        self,
        base_url: str,
        model: str,
        requests: list[ChatRequest],
        *,
        concurrency: int,
        timeout_s: float = 600,
        on_record: Callable[[RequestRecord], None] | None = None,
        cancel: threading.Event | None = None,
        clock_origin: float | None = None,
        duration_s: float | None = None,
        stop_when: Callable[[RequestRecord], bool] | None = None,
        on_start: Callable[[], None] | None = None,
    ) -> LoadResult:
        """One load over the pool's workers: :func:`jobs.load.loadgen.run_load`'s arguments and
        meaning (module docstring: what differs), the merged records and reports back.
        ``on_start`` is called when the workers are armed and told to go.

        Raises:
            ValueError: as ``run_load``; repeated request indexes.
            RuntimeError: not started, or a worker failed or exited during the load.
        """
        _check_args(concurrency, timeout_s, duration_s)
        if not self._procs:
            raise RuntimeError("LoadPool is not started")
        for worker in self._procs:
            if worker.proc.poll() is not None:
                raise RuntimeError(
                    f"load worker {worker.number} has exited (status {worker.proc.returncode})"
                )
        t_call = time.perf_counter()
        origin = t_call if clock_origin is None else clock_origin
        if len({r.index for r in requests}) != len(requests):
            raise ValueError("the pool matches records by index: request indexes must be unique")
        lead = next((pos for pos, r in enumerate(requests) if not r.warmup), len(requests))
        state = _RunState(requests, on_record, stop_when, cancel)
        relay0 = sum(_thread_cpu_s(w.reader) for w in self._procs if w.reader is not None)
        if lead:
            warm: list[tuple[list[int], int, float | None]] = [
                (list(range(lead)), concurrency, None)
            ]
            await self._phase_run(
                state, base_url, model, warm, timeout_s, origin, False, on_go=on_start
            )
            on_start = None
        rest = list(range(lead, len(requests)))
        if rest and not state.stopped:
            shares = _measured_shares(
                requests, rest, self.workers, concurrency, duration_s, self._procs
            )
            await self._phase_run(
                state, base_url, model, shares, timeout_s, origin, True, on_go=on_start
            )
        relay = sum(_thread_cpu_s(w.reader) for w in self._procs if w.reader is not None)
        reports = _merge_reports(state.reports)
        return LoadResult(
            records=[state.records[pos] for pos in sorted(state.records)],
            workers=reports,
            client_cpu_s=sum(r.cpu_s for r in reports) + max(0.0, relay - relay0),
            relay_cpu_s=max(0.0, relay - relay0),
            wall_s=time.perf_counter() - t_call,
        )

    async def _phase_run(
        self,
        state: _RunState,
        base_url: str,
        model: str,
        shares: list[tuple[list[int], int, float | None]],
        timeout_s: float,
        origin: float,
        synced: bool,
        on_go: Callable[[], None] | None = None,
    ) -> None:
        """Run one phase: share ``i`` (positions, slots, duration_s) on worker ``i``."""
        loop = asyncio.get_running_loop()
        self._jobs += 1
        job = self._jobs
        used = self._procs[: len(shares)]
        armed: dict[int, asyncio.Future[None]] = {w.number: loop.create_future() for w in used}
        ended: dict[int, asyncio.Future[None]] = {w.number: loop.create_future() for w in used}

        def stop_all() -> None:
            state.stopped = True
            for w in used:
                with contextlib.suppress(OSError):  # a worker that is gone
                    w.ctrl.send(("stop", job))

        def on_message(number: int, message: tuple[Any, ...]) -> None:
            kind = message[0]
            if kind == "armed":
                _settle(armed[number])
            elif kind == "records":
                if state.take(message[2]):
                    stop_all()
            elif kind == "done":
                state.reports.append(message[2])
                _settle(ended[number])
            elif kind in ("error", "exited") and number in ended:
                what = f"failed:\n{message[2]}" if kind == "error" else f"exited ({message[2]})"
                error = RuntimeError(f"load worker {number} {what}")
                for future in (armed[number], ended[number]):
                    _settle(future, error)

        with self._lock:
            self._phase = _Phase(job, loop, on_message)
        watcher = asyncio.create_task(_watch(state, stop_all))
        try:
            for w, (positions, slots, duration) in zip(used, shares, strict=True):
                share = WorkerJob(
                    job=job,
                    base_url=base_url,
                    model=model,
                    requests=[state.requests[p] for p in positions],
                    concurrency=slots,
                    timeout_s=timeout_s,
                    clock_origin=origin,
                    duration_s=duration,
                )
                w.ctrl.send(("job", share))
            await asyncio.gather(*armed.values())
            start_at = time.perf_counter() + _START_MARGIN_S
            for w in used:
                w.ctrl.send(("go", job, start_at, start_at if synced else None))
            if on_go is not None:  # the load starts now, its workers armed
                on_go()
            await asyncio.gather(*ended.values())
        except BaseException:
            stop_all()
            raise
        finally:
            watcher.cancel()
            with self._lock:
                self._phase = None


def _settle(future: asyncio.Future[None], error: BaseException | None = None) -> None:
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


class _RunState:
    """Records of one load as they arrive, and the caller's callbacks."""

    def __init__(
        self,
        requests: list[ChatRequest],
        on_record: Callable[[RequestRecord], None] | None,
        stop_when: Callable[[RequestRecord], bool] | None,
        cancel: threading.Event | None,
    ) -> None:
        self.requests = requests
        self.on_record = on_record
        self.stop_when = stop_when
        self.cancel = cancel
        self.records: dict[int, RequestRecord] = {}
        self.reports: list[WorkerReport] = []
        self.stopped = False
        self._position = {r.index: pos for pos, r in enumerate(requests)}

    def take(self, records: list[RequestRecord]) -> bool:
        """Keep a batch, call the callbacks; whether ``stop_when`` asked to stop."""
        stop = False
        for record in records:
            self.records[self._position[record.index]] = record
            if self.on_record is not None:
                try:
                    self.on_record(record)
                except Exception:
                    logger.exception("on_record callback failed for request %d", record.index)
            if self.stop_when is not None and self.stop_when(record):
                stop = True
        return stop


async def _watch(state: _RunState, stop_all: Callable[[], None]) -> None:
    """Poll the caller's thread-safe ``cancel``; when set, stop every worker."""
    if state.cancel is None:
        return
    while not state.cancel.is_set():
        await asyncio.sleep(_CANCEL_POLL_S)
    stop_all()


def _measured_shares(
    requests: list[ChatRequest],
    rest: list[int],
    workers: int,
    concurrency: int,
    duration_s: float | None,
    procs: Sequence[_Worker],
) -> list[tuple[list[int], int, float | None]]:
    """The measured phase's shares: positions, slots, and a ``duration_s`` that ends
    every worker at the instant one process would end (the list's first measured
    request sets the start; a worker whose first request is due later has less)."""
    picked = [requests[p] for p in rest]
    shares: list[tuple[list[int], int, float | None]] = []
    first = _first_arrival(picked)
    for positions, slots in assign(picked, min(workers, len(procs)), concurrency):
        mine = [rest[p] for p in positions]
        duration = duration_s
        if duration_s is not None and first is not None:
            own = _first_arrival([requests[p] for p in mine])
            duration = duration_s - ((own if own is not None else first) - first)
            if duration <= 0:
                continue  # every request of this worker is due after the end
        shares.append((mine, slots, duration))
    return shares


def _first_arrival(requests: Sequence[ChatRequest]) -> float | None:
    """``arrival_s`` of the first measured request, None when it has none (closed loop)."""
    first = next((r for r in requests if not r.warmup), None)
    return first.arrival_s if first is not None else None


def _merge_reports(reports: list[WorkerReport]) -> list[WorkerReport]:
    """One report per worker: a worker's warm-up and measured phases added up (the lag
    is the measured phase's: warm-ups have no due times)."""
    merged: dict[int, WorkerReport] = {}
    for r in reports:
        m = merged.get(r.worker)
        if m is None:
            merged[r.worker] = r
            continue
        merged[r.worker] = m.model_copy(
            update={
                "requests": m.requests + r.requests,
                "cpu_s": m.cpu_s + r.cpu_s,
                "wall_s": m.wall_s + r.wall_s,
                "concurrency": max(m.concurrency, r.concurrency),
                "dispatch_lag_p99_ms": r.dispatch_lag_p99_ms or m.dispatch_lag_p99_ms,
                "dispatch_lag_max_ms": r.dispatch_lag_max_ms or m.dispatch_lag_max_ms,
            }
        )
    return [merged[w] for w in sorted(merged)]


async def run_load_workers(
    base_url: str,
    model: str,
    requests: list[ChatRequest],
    *,
    concurrency: int,
    workers: int = 1,
    avoid_cpus: Collection[int] | None = None,
    timeout_s: float = 600,
    on_record: Callable[[RequestRecord], None] | None = None,
    cancel: threading.Event | None = None,
    clock_origin: float | None = None,
    duration_s: float | None = None,
    stop_when: Callable[[RequestRecord], bool] | None = None,
    on_start: Callable[[], None] | None = None,
) -> LoadResult:
    """:func:`jobs.load.loadgen.run_load` over ``workers`` processes, started for this call.

    With ``workers == 1`` and ``avoid_cpus`` None, ``run_load`` runs in this process
    (``in_process``; client CPU = this process's CPU time during the call, all threads).
    Otherwise a :class:`LoadPool` is started for the call (about a second per worker),
    run once and closed; to run many loads, keep a ``LoadPool``. ``on_start`` is called
    (on this loop) as the load's dispatch starts, after the workers' start-up and arming.
    """
    _check_args(concurrency, timeout_s, duration_s)
    if workers == 1 and avoid_cpus is None:
        if on_start is not None:
            on_start()
        t0, cpu0 = time.perf_counter(), time.process_time()
        records = await run_load(
            base_url,
            model,
            requests,
            concurrency=concurrency,
            timeout_s=timeout_s,
            on_record=on_record,
            cancel=cancel,
            clock_origin=clock_origin,
            duration_s=duration_s,
            stop_when=stop_when,
        )
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        lag_p99, lag_max = lag_stats_ms(records)
        report = WorkerReport(
            worker=0,
            pid=os.getpid(),
            cpus=sorted(os.sched_getaffinity(0)),
            requests=len(records),
            concurrency=concurrency,
            cpu_s=cpu,
            wall_s=wall,
            dispatch_lag_p99_ms=lag_p99,
            dispatch_lag_max_ms=lag_max,
        )
        return LoadResult(
            records=records, workers=[report], client_cpu_s=cpu, wall_s=wall, in_process=True
        )
    pool = LoadPool(workers, avoid_cpus=avoid_cpus)
    await asyncio.to_thread(pool.start)
    try:
        return await pool.run(
            base_url,
            model,
            requests,
            concurrency=concurrency,
            timeout_s=timeout_s,
            on_record=on_record,
            cancel=cancel,
            clock_origin=clock_origin,
            duration_s=duration_s,
            stop_when=stop_when,
            on_start=on_start,
        )
    finally:
        await asyncio.to_thread(pool.close)
