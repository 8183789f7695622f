"""Streaming load generator (closed or open loop) and client-side metrics, as ``vllm bench serve``.

:func:`run_load` drives a vLLM OpenAI-compatible server with streamed requests
and times every one of them: ``/v1/chat/completions`` for chat requests,
``/v1/completions`` for requests with a ``prompt``. :func:`summarize` turns
the per-request records into the summary numbers.

How requests are driven (:class:`~jobs.schemas.ChatRequest` fields):

- **closed loop** (``arrival_s`` None): the next request is sent as soon as
  fewer than ``concurrency`` requests are in flight (``vllm bench serve
  --request-rate inf --max-concurrency N``);
- **open loop** (``arrival_s`` set): the request is sent at ``t_begin +
  arrival_s`` whatever the requests before it are doing, where ``t_begin`` is
  when the first measured request came up for dispatch; ``concurrency`` still
  caps the requests in flight, like ``--max-concurrency``'s semaphore in
  ``vllm bench serve --request-rate R``. Due times are absolute (no drift
  from accumulated sleeps); each record keeps its due time in ``scheduled_s``
  so ``start_s - scheduled_s`` is how late the request went out;
- **dependencies** (``after``): a request waits until the request with that
  ``index`` has finished (multi-turn conversations);
- dispatch is always in list order, and ``duration_s`` can cut the measured
  phase short.

One request's body, stream parsing and record: :mod:`jobs.load.streamrequest`.
HTTP goes through :mod:`jobs.load.sseclient` (plain ``http://``, keep-alive connections
reused, at most ``concurrency`` of them; lines parsed and timed where the bytes
arrive, which costs about half the CPU of aiohttp's stream reader, the transport of
``vllm bench serve``), no settings from the environment (proxies), and ``timeout_s``
per request. Several processes sharing one schedule: :mod:`jobs.load.loadpool`.

Metric definitions follow ``vllm bench serve`` (vLLM ``vllm/benchmarks/serve.py``,
``calculate_metrics`` and ``benchmark``; request timing in
``vllm/benchmarks/lib/endpoint_request_func.py``,
``async_request_openai_chat_completions`` and ``async_request_openai_completions``):

- **TTFT** (time to first token): from just before the request is sent to the
  arrival of the first streamed chunk carrying content.
- **ITL** (inter-token latency): the gaps between successive content chunks of
  one request; the summary pools the gaps of all successful requests.
- **E2EL** (end-to-end latency): from just before the request is sent to the
  arrival of the last content chunk (the trailing usage chunk and ``[DONE]``
  do not extend it), so ``E2EL = TTFT + sum(ITL)``.
- **TPOT** (time per output token, excluding the first):
  ``(E2EL - TTFT) / (output_tokens - 1)`` for requests with more than one
  output token; other requests have no TPOT.
- **request_throughput** = completed / duration; **output_throughput** =
  total output tokens / duration; **total_token_throughput** = (total input +
  total output tokens) / duration (requests/s, tokens/s; failed requests count
  zero tokens).
- **request_goodput** = requests meeting every given SLO / duration, an SLO
  ``{"ttft"|"tpot"|"e2el": ms}`` being met when ``value <= slo``; a request
  with at most one output token has TPOT 0 for this test (as vLLM does).
- Statistics per metric: ``mean`` (``numpy.mean``), ``median``
  (``numpy.median``), ``std`` (``numpy.std``, population, ddof=0) and
  ``pNN`` (``numpy.percentile``, its default linear interpolation), all in
  milliseconds; key names ``{stat}_{metric}_ms`` as in vLLM's result JSON
  (``p99.9`` keeps its decimal: ``p99.9_ttft_ms``).

Deviations from ``vllm bench serve`` (deliberate, small):

- TTFT starts at the first chunk with *non-empty* content (``delta.content``
  for chat, ``text`` for completions); vLLM >= 0.11's client starts it at any
  chunk with ``choices``, which includes the role-only first chunk of a chat
  stream (older vLLM clients used non-empty content, as here). Against vLLM
  itself both agree: the server sends the role chunk right before the first
  token.
- The chat body carries ``max_tokens`` (vLLM's client sends
  ``max_completion_tokens``; vLLM's server treats both alike).
- When a statistic has no data (e.g. no successful request, or no request
  with more than one output token for TPOT) its keys are omitted instead of
  reported as 0.
- Output tokens come from the server's ``usage`` chunk; if a server sends none,
  the number of content chunks is used (vLLM falls back to re-tokenizing).
- Extra keys: ``goodput_fraction``, ``total_cached_tokens`` and the dispatch
  lag (see :func:`summarize`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import numpy as np

from jobs.load.sseclient import ConnectionPool
from jobs.load.streamrequest import MAX_ERROR_CHARS, one_request, record_fields, refused
from jobs.schemas import ChatRequest, RequestRecord

__all__ = ["refused", "run_load", "summarize"]

logger = logging.getLogger(__name__)

_CANCEL_POLL_S = 0.05
_SLO_NAMES = ("ttft", "tpot", "e2el")

# Dispatch state of a request (by position in the list).
_PENDING, _SENT, _FINISHED, _NOT_SENT = 0, 1, 2, 3


async def _sleep_until(due: float) -> None:
    """Sleep until ``time.perf_counter() >= due`` (event-loop timer, ~1 ms late at most)."""
    while (left := due - time.perf_counter()) > 0:
        await asyncio.sleep(left)


async def run_load(
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
    schedule_origin: float | None = None,
) -> list[RequestRecord]:
    """Send ``requests`` to the server, closed or open loop, and time each one.

    Each request is streamed (``stream`` with ``stream_options.include_usage``,
    ``ignore_eos``, ``temperature`` 0, ``max_tokens`` from the request) for
    ``model`` (the served model name): ``POST {base_url}/v1/completions`` with
    ``prompt`` when the request has one, else ``POST {base_url}/v1/chat/completions``
    with ``messages``. The request's ``extra_body`` is merged into the body and
    may override any field except ``model``, ``stream``, ``stream_options``,
    ``messages``/``prompt`` and ``max_tokens``.

    Dispatch, strictly in list order (request ``k+1`` is never sent before
    request ``k``); for each request in turn:

    1. open loop (``arrival_s`` set, measured requests only): wait until
       ``t_begin + arrival_s``, where ``t_begin`` is the moment the first
       non-warm-up request of the list came up for dispatch (the call's start
       for a list without warm-ups), or ``schedule_origin``; the due time is kept in the record's
       ``scheduled_s``. Warm-ups ignore ``arrival_s``.
    2. ``after`` set: wait until the earlier request with that ``index`` has
       finished, successfully or not. If no earlier request has that index
       (absent, or only later in the list, which would deadlock), or that
       request was never sent itself, this request is not sent and gets a
       failed record saying so. While it waits, the requests after it wait too
       (list order): put conversations' turns in turn-major order so that
       other conversations' turns are not held back.
    3. wait until fewer than ``concurrency`` requests are in flight, then send.

    Args:
        base_url: server root, e.g. ``"http://127.0.0.1:8000"`` (no trailing path).
        model: served model name put in each body.
        requests: the request list. Warm-up requests are the caller's business:
            put them first with ``warmup=True`` (they are sent like the others,
            closed loop).
        concurrency: at most this many requests in flight, >= 1 (closed loop:
            the next one is sent as soon as one finishes; open loop: the cap
            of ``--max-concurrency``, a due request waits for a free slot).
        timeout_s: total time limit per request (seconds), connect to last byte.
        on_record: called with each finished record (in the event-loop thread,
            in completion order); an exception in it is logged, not raised.
        cancel: when set (from any thread), no new request is dispatched and
            the requests in flight are aborted (within ~50 ms); the records of
            the requests that had finished are returned.
        clock_origin: a ``time.perf_counter()`` value that ``start_s`` and
            ``scheduled_s`` offsets are measured from; default: the moment this
            call starts.
        duration_s: when set (> 0), no request is dispatched later than
            ``duration_s`` seconds after the first measured request was sent;
            requests in flight then finish, unsent ones get no record.
        stop_when: called with each finished record; when it answers True the
            load stops at once, as for ``cancel`` (e.g. :func:`refused`: the
            server's port refused a connection, so the server is gone and every
            further request would only fail).
        schedule_origin: a ``time.perf_counter()`` value to count open-loop
            ``arrival_s`` from instead (several processes sharing one schedule).

    Returns:
        One :class:`~jobs.schemas.RequestRecord` per finished request, in
        request-list order. Times in seconds; see the module docstring for the
        definitions; ``conversation``/``turn`` are copied from the request. A
        failed request (HTTP status other than 200, connection refused or
        reset, a server that stopped answering, timeout, an ``error`` chunk,
        bad JSON, a stream without any content chunk, an unmet ``after``)
        gives ``success=False`` and ``error`` text; this function never raises
        for a single request's failure.

    Size: the code is a few lines (the dispatch is :class:`_Load`'s); the rest is the
    contract of each argument.

    Raises:
        ValueError: ``concurrency < 1``, ``timeout_s <= 0``, ``duration_s``
            not a positive finite number, or ``base_url`` not ``http://``.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a positive finite number, got {duration_s}")
    origin = time.perf_counter() if clock_origin is None else clock_origin
    if not requests:
        return []
    load = _Load(
        requests,
        model=model,
        concurrency=concurrency,
        timeout_s=timeout_s,
        origin=origin,
        duration_s=duration_s,
        schedule_origin=schedule_origin,
        on_record=on_record,
        stop_when=stop_when,
        cancel=cancel,
    )
    # Keep-alive connections, reused: dispatch never has more than ``concurrency`` requests
    # in flight, so no more connections than that. ``timeout_s`` applies per request
    # (``asyncio.timeout``), connect to last byte. No proxy or other environment settings.
    async with _frozen_heap(), ConnectionPool(base_url.rstrip("/")) as pool:
        await load.run(pool)
    return [load.records[pos] for pos in sorted(load.records)]


class _Load:
    """One :func:`run_load` call: what was sent and finished, the dispatch loop, the stop."""

    def __init__(
        self,
        requests: list[ChatRequest],
        *,
        model: str,
        concurrency: int,
        timeout_s: float,
        origin: float,
        duration_s: float | None,
        schedule_origin: float | None,
        on_record: Callable[[RequestRecord], None] | None,
        stop_when: Callable[[RequestRecord], bool] | None,
        cancel: threading.Event | None,
    ) -> None:
        self.requests = requests
        self.model = model
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.origin = origin
        self.duration_s = duration_s
        self.schedule_origin = schedule_origin
        self.on_record = on_record
        self.stop_when = stop_when
        self.cancel = cancel
        self.records: dict[int, RequestRecord] = {}  # by position in ``requests``
        self.started_at: dict[int, float] = {}  # by position: perf_counter() timing starts from
        self.state = [_PENDING] * len(requests)
        self.all_indexes = {r.index for r in requests}
        self.position_of: dict[int, int] = {}  # index -> position of its latest occurrence
        self.in_flight = 0
        self.finished = asyncio.Event()  # set whenever a sent request finishes
        self.tasks: list[asyncio.Task[None]] = []
        self.dispatcher: asyncio.Task[None] | None = None

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def past(self, stop_at: float | None) -> bool:
        """Cancelled, or the ``duration_s`` deadline has passed: dispatch no more."""
        return self.cancelled() or (stop_at is not None and time.perf_counter() >= stop_at)

    def abort(self, spare: asyncio.Task[Any] | None = None) -> None:
        """Cancel the dispatch and every request in flight but ``spare``."""
        if self.dispatcher is not None:
            self.dispatcher.cancel()
        for task in self.tasks:
            if task is not spare:
                task.cancel()

    def deliver(self, pos: int, record: RequestRecord) -> None:
        self.records[pos] = record
        if self.on_record is not None:
            try:
                self.on_record(record)
            except Exception:
                logger.exception("on_record callback failed for request %d", pos)
        if self.stop_when is not None and self.stop_when(record):
            # from inside a request's task: that one ends by itself
            self.abort(spare=asyncio.current_task())

    async def wait_until(self, condition: Callable[[], bool], deadline: float | None) -> bool:
        """Wait until ``condition()`` (re-checked as requests finish); False at ``deadline``."""
        while not condition():
            self.finished.clear()
            if deadline is None:
                await self.finished.wait()
                continue
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.finished.wait(), left)
        return True

    def slot_free(self) -> bool:
        return self.in_flight < self.concurrency

    async def send(self, pool: ConnectionPool, pos: int, scheduled_s: float | None) -> None:
        try:
            record = await one_request(
                pool,
                self.model,
                self.requests[pos],
                timeout_s=self.timeout_s,
                origin=self.origin,
                scheduled_s=scheduled_s,
                on_start=lambda t: self.started_at.__setitem__(pos, t),
            )
            self.state[pos] = _FINISHED
            self.deliver(pos, record)
        finally:
            self.in_flight -= 1
            self.finished.set()

    async def dependency(self, after: int, stop_at: float | None) -> tuple[bool, str | None]:
        """Wait for the request with index ``after``: (go on, why this one cannot be sent).

        Go on is False when ``stop_at`` came first; the reason is None when it may be sent.
        """
        dep = self.position_of.get(after)
        if dep is None:
            where = (
                "comes only at or after this one in the list"
                if after in self.all_indexes
                else "is not in the request list"
            )
            return True, f"request {after}, which must finish first, {where}"
        if not await self.wait_until(lambda: self.state[dep] >= _FINISHED, stop_at):
            return False, None
        if self.state[dep] == _NOT_SENT:
            return True, (
                f"request {after}, which must finish first, never ran: {self.records[dep].error}"
            )[:MAX_ERROR_CHARS]
        return True, None

    async def dispatch(self, pool: ConnectionPool) -> None:
        """Send the requests in list order (the steps in :func:`run_load`'s docstring)."""
        t_begin: float | None = None
        stop_at: float | None = None  # duration_s deadline, once the first was sent
        for pos, request in enumerate(self.requests):
            if self.past(stop_at):
                return
            measured = not request.warmup
            if measured and t_begin is None:
                t_begin = self.schedule_origin
                if t_begin is None:
                    t_begin = time.perf_counter()
            scheduled_s: float | None = None
            if measured and request.arrival_s is not None:
                assert t_begin is not None
                due = t_begin + request.arrival_s
                scheduled_s = due - self.origin
                if stop_at is not None and due >= stop_at:
                    return
                await _sleep_until(due)
                if self.cancelled():
                    return
            if request.after is not None:
                go_on, problem = await self.dependency(request.after, stop_at)
                if not go_on:
                    return
                if problem is not None:
                    self.position_of[request.index] = pos
                    fields = record_fields(request, time.perf_counter() - self.origin, scheduled_s)
                    self.state[pos] = _NOT_SENT
                    self.deliver(pos, RequestRecord(success=False, error=problem, **fields))
                    continue
            if not await self.wait_until(self.slot_free, stop_at) or self.past(stop_at):
                return
            self.position_of[request.index] = pos
            self.in_flight += 1
            self.state[pos] = _SENT
            self.tasks.append(asyncio.create_task(self.send(pool, pos, scheduled_s)))
            # let it start now (its start_s is taken when it runs; tasks run FIFO)
            await asyncio.sleep(0)
            if measured and self.duration_s is not None and stop_at is None:
                stop_at = self.started_at.get(pos, time.perf_counter()) + self.duration_s

    async def run(self, pool: ConnectionPool) -> None:
        """Dispatch, wait for what is in flight, and cancel everything on the way out."""
        dispatcher = self.dispatcher = asyncio.create_task(self.dispatch(pool))
        cancel = self.cancel
        watcher = asyncio.create_task(_watch_cancel(cancel, self.abort)) if cancel else None
        try:
            # wait() (unlike gather) does not raise when the watcher cancels the tasks;
            # a cancellation of this coroutine itself still propagates from here.
            await asyncio.wait([dispatcher])
            pending = [task for task in self.tasks if not task.done()]
            if pending:
                await asyncio.wait(pending)
        finally:
            if watcher is not None:
                watcher.cancel()
            self.abort()
            await asyncio.gather(
                dispatcher, *self.tasks, *([watcher] if watcher else []), return_exceptions=True
            )
        for task in [dispatcher, *self.tasks]:
            if not task.cancelled() and (exc := task.exception()) is not None:
                raise exc  # a bug, not a request failure (those become records)


@contextlib.asynccontextmanager
async def _frozen_heap() -> AsyncIterator[None]:
    """Keep the objects that exist before a load out of the garbage collector's scans.

    A full collection scans every tracked object of the process (the caller's too) and
    stops the event loop meanwhile: no request goes out, no line is timed (measured:
    55 ms pauses, a dispatch lag p99 of 59 ms at 800 req/s, none with this). ``gc.freeze``
    moves what exists now out of its sight; what the load creates is still collected;
    ``gc.unfreeze`` at the end gives the rest back (loads that overlap in one process
    thaw it when the first ends).
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def _watch_cancel(cancel: threading.Event | None, abort: Callable[[], None]) -> None:
    """Poll the thread-safe ``cancel`` event; when set, call ``abort``."""
    if cancel is None:
        return
    while not cancel.is_set():
        await asyncio.sleep(_CANCEL_POLL_S)
    abort()


def _percentile_word(p: float) -> str:
    """vLLM's key spelling of a percentile: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def _stats_ms(name: str, values_s: list[float], percentiles: Iterable[float]) -> dict[str, float]:
    """``mean_/median_/std_/pNN_{name}_ms`` of ``values_s`` (seconds); {} when empty."""
    if not values_s:
        return {}
    arr = np.asarray(values_s, dtype=float) * 1000.0
    out = {
        f"mean_{name}_ms": float(np.mean(arr)),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(np.std(arr)),
    }
    for p in percentiles:
        out[f"p{_percentile_word(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    *,
    selected_percentiles: Iterable[float] = (50, 90, 99),
    goodput_slos_ms: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Summary metrics of the measured (non-warm-up) requests, named as ``vllm bench serve``.

    Args:
        records: records from :func:`run_load`; ``warmup=True`` ones are ignored.
        duration_s: wall-clock duration of the measured phase in seconds (> 0),
            the denominator of every throughput.
        selected_percentiles: percentiles in [0, 100] for the ``pNN_*`` keys.
            50 is always added, so ``p50_*`` (equal to ``median_*``) is present.
        goodput_slos_ms: optional SLOs in milliseconds keyed ``ttft``,
            ``tpot``, ``e2el``; when given, ``request_goodput`` is reported.

    Returns:
        Flat ``{key: float}`` without NaN or infinity:

        - always: ``duration`` (s), ``completed``, ``failed`` (request
          counts), ``total_input_tokens``, ``total_output_tokens``
          (successful requests only);
        - ``total_cached_tokens``: sum of ``cached_tokens`` (prompt tokens the
          server served from its prefix cache, ``usage.prompt_tokens_details``)
          over the successful requests that report it; absent when none does;
        - ``mean_dispatch_lag_ms``, ``max_dispatch_lag_ms``: ``start_s -
          scheduled_s`` over the measured records (failed ones included) that
          have a ``scheduled_s`` (open loop); absent otherwise. How late the
          client sent requests: it includes waits for a free ``concurrency``
          slot and for an ``after`` dependency, so with neither binding a
          growing lag means the client itself is the bottleneck;
        - with at least one successful request: ``request_throughput``
          (req/s), ``output_throughput``, ``total_token_throughput``
          (tokens/s), with SLOs ``request_goodput`` (req/s) and
          ``goodput_fraction`` (requests meeting every SLO / ``completed``,
          0-1), and
          ``mean_/median_/std_/pNN_`` + ``ttft_ms``, ``tpot_ms``, ``itl_ms``,
          ``e2el_ms`` for each metric that has data. ITL pools the gaps of all
          successful requests; TPOT covers requests with > 1 output token.

    Raises:
        ValueError: ``duration_s`` not a positive finite number, a percentile
            outside [0, 100], or an unknown SLO name.

    Source: ``calculate_metrics`` and ``benchmark`` in vLLM
    ``vllm/benchmarks/serve.py``; see the module docstring for deviations.
    """
    percentiles, slos = _summary_args(duration_s, selected_percentiles, goodput_slos_ms)
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.success and r.ttft_s is not None and r.e2el_s is not None]
    out = _counts(measured, ok, duration_s)
    if not ok:
        return out
    out["request_throughput"] = len(ok) / duration_s
    out["output_throughput"] = out["total_output_tokens"] / duration_s
    total_tokens = out["total_input_tokens"] + out["total_output_tokens"]
    out["total_token_throughput"] = total_tokens / duration_s
    if slos:
        good = sum(1 for r in ok if _meets_slos(r, slos))
        out["request_goodput"] = good / duration_s
        out["goodput_fraction"] = good / len(ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2els = [r.e2el_s for r in ok if r.e2el_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out.update(_stats_ms(name, values, percentiles))
    return out


def _counts(
    measured: list[RequestRecord], ok: list[RequestRecord], duration_s: float
) -> dict[str, float]:
    """:func:`summarize`'s keys that need no successful request: counts, tokens, lags."""
    out: dict[str, float] = {
        "duration": float(duration_s),
        "completed": float(len(ok)),
        "failed": float(len(measured) - len(ok)),
        "total_input_tokens": float(sum(r.prompt_tokens or 0 for r in ok)),
        "total_output_tokens": float(sum(r.output_tokens or 0 for r in ok)),
    }
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    if cached:
        out["total_cached_tokens"] = float(sum(cached))
    lags = [r.start_s - r.scheduled_s for r in measured if r.scheduled_s is not None]
    if lags:
        out["mean_dispatch_lag_ms"] = float(np.mean(lags)) * 1000.0
        out["max_dispatch_lag_ms"] = float(np.max(lags)) * 1000.0
    return out


def _summary_args(
    duration_s: float,
    selected_percentiles: Iterable[float],
    goodput_slos_ms: Mapping[str, float] | None,
) -> tuple[list[float], dict[str, float]]:
    """:func:`summarize`'s percentiles (50 added, sorted) and SLOs, checked (ValueError)."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a positive finite number, got {duration_s}")
    percentiles = sorted({50.0, *(float(p) for p in selected_percentiles)})
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ValueError(f"percentiles must be within [0, 100], got {percentiles}")
    slos = dict(goodput_slos_ms or {})
    unknown = set(slos) - set(_SLO_NAMES)
    if unknown:
        raise ValueError(f"unknown SLO names {sorted(unknown)}; valid: {list(_SLO_NAMES)}")
    return percentiles, slos


def _meets_slos(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    """Whether a successful record meets every SLO (ms); TPOT 0 below two output tokens."""
    value_s = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2el_s}
    return all((value_s[k] or 0.0) * 1000.0 <= slo for k, slo in slos.items())
