"""One process of the multi-process load generator (:mod:`jobs.load.loadpool`): its side of the
pipes.

:class:`jobs.load.loadpool.LoadPool` starts a Python that calls :func:`main` with ``IN_FD OUT_FD
WORKER [CPUS]`` (two pipes). The worker pins itself to ``CPUS`` (comma-separated, optional,
``os.sched_setaffinity``), says ``("ready", pid, cpus)``, then serves jobs until told
to exit, one at a time:

- ``("job", WorkerJob)``: its share of a load (:func:`jobs.load.loadgen.run_load` arguments);
  answered ``("armed", job)`` once unpacked;
- ``("go", job, start_at, schedule_origin)``: sleep until ``start_at``
  (``time.perf_counter()``, a clock all processes of a Linux node share), then run
  :func:`~jobs.load.loadgen.run_load` with ``schedule_origin``; finished records go back
  in batches (``("records", job, [RequestRecord, ...])`` every :data:`FLUSH_S`), then
  ``("done", job, WorkerReport)`` or ``("error", job, text)``;
- ``("stop", job)``: stop that job as ``run_load``'s ``cancel`` does;
- ``("exit",)``, or the parent's end of the pipe closing: exit.

The worker's CPU time for a job is its process CPU time (``time.process_time()``:
every thread, user and system) from ``go`` to ``done``.
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from jobs.load.loadgen import run_load
from jobs.schemas import ChatRequest, RequestRecord

__all__ = ["FLUSH_S", "WorkerJob", "WorkerReport", "lag_stats_ms", "main"]

FLUSH_S = 0.05
"""How often a worker sends the records finished since its last batch (seconds)."""


class WorkerJob(BaseModel):
    """A worker's share of one load: :func:`jobs.load.loadgen.run_load`'s arguments."""

    job: int
    base_url: str
    model: str
    requests: list[ChatRequest]
    concurrency: int = Field(ge=1)
    timeout_s: float
    clock_origin: float
    duration_s: float | None = None


class WorkerReport(BaseModel):
    """What one load-generator process did during one load."""

    worker: int = Field(description="0-based worker number")
    pid: int = Field(description="its process id")
    cpus: list[int] = Field(description="the cores it was allowed to run on")
    requests: int = Field(description="records it produced (sent, or refused before sending)")
    concurrency: int = Field(description="its cap on requests in flight")
    cpu_s: float = Field(description="its process CPU seconds (user + system) for the load")
    wall_s: float = Field(description="seconds from its start to its last record")
    dispatch_lag_p99_ms: float | None = Field(
        None, description="p99 of start_s - scheduled_s over its open-loop requests (ms)"
    )
    dispatch_lag_max_ms: float | None = None


def lag_stats_ms(records: list[RequestRecord]) -> tuple[float | None, float | None]:
    """p99 and max of ``start_s - scheduled_s`` (ms) over the records that have a due time."""
    lags = [r.start_s - r.scheduled_s for r in records if r.scheduled_s is not None]
    if not lags:
        return None, None
    return float(np.percentile(lags, 99)) * 1000.0, float(max(lags)) * 1000.0


class _Stops:
    """Which jobs the parent asked to stop, and the event of the job running now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped: set[int] = set()
        self._current: tuple[int, threading.Event] | None = None

    def stop(self, job: int) -> None:
        with self._lock:
            self._stopped.add(job)
            if self._current is not None and self._current[0] == job:
                self._current[1].set()

    def begin(self, job: int) -> threading.Event:
        event = threading.Event()
        with self._lock:
            self._current = (job, event)
            if job in self._stopped:
                event.set()
        return event


def _read_control(conn: Connection, inbox: queue.Queue[tuple[Any, ...]], stops: _Stops) -> None:
    """Forward the parent's messages to ``inbox``; a ``stop`` takes effect here at once."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = ("exit",)
        if message[0] == "stop":
            stops.stop(message[1])
            continue
        inbox.put(message)
        if message[0] == "exit":
            return


async def _run_job(
    worker: int,
    cpus: list[int],
    job: WorkerJob,
    start_at: float,
    schedule_origin: float | None,
    cancel: threading.Event,
    out: Connection,
) -> WorkerReport:
    cpu0 = time.process_time()
    batch: list[RequestRecord] = []

    def flush() -> None:
        if batch:
            out.send(("records", job.job, list(batch)))
            batch.clear()

    async def flush_every() -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            flush()

    while (left := start_at - time.perf_counter()) > 0:
        await asyncio.sleep(left)
    flusher = asyncio.create_task(flush_every())
    try:
        records = await run_load(
            job.base_url,
            job.model,
            job.requests,
            concurrency=job.concurrency,
            timeout_s=job.timeout_s,
            on_record=batch.append,
            cancel=cancel,
            clock_origin=job.clock_origin,
            duration_s=job.duration_s,
            schedule_origin=schedule_origin,
        )
    finally:
        flusher.cancel()
    flush()
    wall = time.perf_counter() - start_at
    lag_p99, lag_max = lag_stats_ms(records)
    return WorkerReport(
        worker=worker,
        pid=os.getpid(),
        cpus=cpus,
        requests=len(records),
        concurrency=job.concurrency,
        cpu_s=time.process_time() - cpu0,
        wall_s=wall,
        dispatch_lag_p99_ms=lag_p99,
        dispatch_lag_max_ms=lag_max,
    )


def serve(worker: int, inp: Connection, out: Connection, cpus: list[int] | None) -> None:
    """The worker's life: pin, say ready, run jobs until ``exit``."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    allowed = sorted(os.sched_getaffinity(0))
    out.send(("ready", os.getpid(), allowed))
    inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
    stops = _Stops()
    threading.Thread(target=_read_control, args=(inp, inbox, stops), daemon=True).start()
    job: WorkerJob | None = None
    while True:
        message = inbox.get()
        kind = message[0]
        if kind == "exit":
            return
        if kind == "job":
            job = message[1]
            out.send(("armed", job.job))
        elif kind == "go" and job is not None and job.job == message[1]:
            _, number, start_at, schedule_origin = message
            cancel = stops.begin(number)
            try:
                report = asyncio.run(
                    _run_job(worker, allowed, job, start_at, schedule_origin, cancel, out)
                )
            except Exception:
                out.send(("error", number, traceback.format_exc()[-4000:]))
            else:
                out.send(("done", number, report))
            job = None


def main(argv: list[str] | None = None) -> None:
    """The worker's entry: ``IN_FD OUT_FD WORKER [CPUS]`` (``sys.argv[1:]``, by the pool)."""
    args = sys.argv[1:] if argv is None else argv
    inp = Connection(int(args[0]), writable=False)
    out = Connection(int(args[1]), readable=False)
    cpus = [int(c) for c in args[3].split(",")] if len(args) > 3 and args[3] else None
    try:
        serve(int(args[2]), inp, out, cpus)
    except (BrokenPipeError, EOFError):  # the parent is gone
        pass
    finally:
        out.close()
