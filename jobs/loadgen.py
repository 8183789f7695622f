"""Closed-loop streaming load generator and client-side metrics, as ``vllm bench serve``.

:func:`run_load` drives a vLLM OpenAI-compatible server's ``/v1/chat/completions``
endpoint with streamed requests and times every one of them;
:func:`summarize` turns the per-request records into the summary numbers.

Metric definitions follow ``vllm bench serve`` (vLLM ``vllm/benchmarks/serve.py``,
``calculate_metrics`` and ``benchmark``; request timing in
``vllm/benchmarks/lib/endpoint_request_func.py``,
``async_request_openai_chat_completions``):

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

- TTFT starts at the first chunk with *non-empty* ``delta.content`` (vLLM
  >= 0.11's client starts it at any chunk with ``choices``, which includes the
  role-only first chunk; older vLLM clients used non-empty content, as here).
- Load is closed loop only (``--max-concurrency`` with ``--request-rate inf``).
- When a statistic has no data (e.g. no successful request, or no request
  with more than one output token for TPOT) its keys are omitted instead of
  reported as 0.
- Output tokens come from the server's ``usage`` chunk; if a server sends none,
  the number of content chunks is used (vLLM falls back to re-tokenizing).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx
import numpy as np

from jobs.schemas import ChatRequest, RequestRecord

__all__ = ["CHAT_PATH", "run_load", "summarize"]

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
"""Path of the OpenAI-compatible chat endpoint, appended to ``base_url``."""

_CANCEL_POLL_S = 0.05
_MAX_ERROR_CHARS = 500
_SLO_NAMES = ("ttft", "tpot", "e2el")


class _RequestFailed(Exception):
    """A request failed in a way the stream itself reported (status, error chunk)."""


def _chat_body(model: str, request: ChatRequest) -> dict[str, Any]:
    return {
        "model": model,
        "messages": request.messages,
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text}"[:_MAX_ERROR_CHARS] if text else name


def _delta_content(chunk: dict[str, Any]) -> str:
    """``choices[0].delta.content`` of a chat stream chunk, ``""`` when absent or malformed."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    delta = choices[0].get("delta")
    content = delta.get("content") if isinstance(delta, dict) else None
    return content if isinstance(content, str) else ""


async def _one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    request: ChatRequest,
    *,
    timeout_s: float,
    origin: float,
) -> RequestRecord:
    """Send one streamed chat request and time it; never raises for request errors."""
    body = _chat_body(model, request)
    start = time.perf_counter()
    first: float | None = None
    last: float | None = None
    itl: list[float] = []
    content_chunks = 0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None
    try:
        async with asyncio.timeout(timeout_s), client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                detail = raw.decode("utf-8", "replace").strip()
                raise _RequestFailed(f"HTTP {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (":ping"), event/id fields
                payload = line[len("data:") :].strip()
                if not payload:
                    continue
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(payload)
                if not isinstance(chunk, dict):
                    continue
                if chunk.get("error") or chunk.get("object") == "error":
                    # vLLM streams errors as {"error": {...}} (newer) or {"object": "error", ...}
                    raise _RequestFailed(f"error chunk: {json.dumps(chunk)}")
                if _delta_content(chunk):
                    content_chunks += 1
                    if first is None:
                        first = now
                    elif last is not None:
                        itl.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    if usage.get("prompt_tokens") is not None:
                        prompt_tokens = int(usage["prompt_tokens"])
                    if usage.get("completion_tokens") is not None:
                        output_tokens = int(usage["completion_tokens"])
    except _RequestFailed as exc:
        error = str(exc)[:_MAX_ERROR_CHARS]
    except TimeoutError:
        error = f"timeout after {timeout_s:g} s"
    except (httpx.HTTPError, OSError, ValueError, TypeError) as exc:  # bad JSON or usage
        error = _error_text(exc)

    start_s = start - origin
    if error is None and (first is None or last is None):
        error = "stream ended without any content chunk"
    if error is not None:
        return RequestRecord(
            index=request.index,
            warmup=request.warmup,
            request_class=request.request_class,
            success=False,
            error=error,
            start_s=start_s,
            prompt_tokens=prompt_tokens,
        )
    assert first is not None and last is not None
    if output_tokens is None:
        output_tokens = content_chunks
    ttft = first - start
    e2el = last - start
    tpot = (e2el - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    return RequestRecord(
        index=request.index,
        warmup=request.warmup,
        request_class=request.request_class,
        success=True,
        start_s=start_s,
        ttft_s=ttft,
        itl_s=itl,
        tpot_s=tpot,
        e2el_s=e2el,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
    )


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
) -> list[RequestRecord]:
    """Send ``requests`` to ``{base_url}/v1/chat/completions`` in a closed loop; time each.

    Each request is a streamed chat completion (``stream`` with
    ``stream_options.include_usage``, ``ignore_eos``, ``temperature`` 0,
    ``max_tokens`` from the request) for ``model`` (the served model name).

    Args:
        base_url: server root, e.g. ``"http://127.0.0.1:8000"`` (no trailing path).
        model: served model name put in each body.
        requests: the request list; dispatched strictly in list order (request
            ``k+1`` is never sent before request ``k``). Warm-up requests are
            the caller's business: put them first with ``warmup=True``.
        concurrency: closed-loop limit, >= 1: at most this many requests in
            flight; a new one is sent as soon as one finishes.
        timeout_s: total time limit per request (seconds), connect to last byte.
        on_record: called with each finished record (in the event-loop thread,
            in completion order); an exception in it is logged, not raised.
        cancel: when set (from any thread), no new request is dispatched and
            the requests in flight are aborted (within ~50 ms); the records of
            the requests that had finished are returned.
        clock_origin: a ``time.perf_counter()`` value that ``start_s`` offsets
            are measured from; default: the moment this call starts.

    Returns:
        One :class:`~jobs.schemas.RequestRecord` per finished request, in
        request-list order. Times in seconds; see the module docstring for the
        definitions. A failed request (HTTP status other than 200, connection
        error, timeout, an ``error`` chunk, bad JSON, a stream without any
        content chunk) gives ``success=False`` and ``error`` text; this
        function never raises for a single request's failure.

    Raises:
        ValueError: ``concurrency < 1`` or ``timeout_s <= 0``.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    origin = time.perf_counter() if clock_origin is None else clock_origin
    if not requests:
        return []
    url = base_url.rstrip("/") + CHAT_PATH
    n_workers = min(concurrency, len(requests))
    records: dict[int, RequestRecord] = {}  # by position in ``requests``
    next_pos = 0

    def cancelled() -> bool:
        return cancel is not None and cancel.is_set()

    limits = httpx.Limits(max_connections=n_workers, max_keepalive_connections=n_workers)
    timeout = httpx.Timeout(timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            nonlocal next_pos
            while not cancelled() and next_pos < len(requests):
                pos = next_pos  # taken and advanced without an await in between
                next_pos += 1
                record = await _one_request(
                    client, url, model, requests[pos], timeout_s=timeout_s, origin=origin
                )
                records[pos] = record
                if on_record is not None:
                    try:
                        on_record(record)
                    except Exception:
                        logger.exception("on_record callback failed for request %d", pos)

        workers = [asyncio.create_task(worker()) for _ in range(n_workers)]
        watcher = asyncio.create_task(_watch_cancel(cancel, workers)) if cancel else None
        try:
            # wait() (unlike gather) does not raise when the watcher cancels the workers;
            # a cancellation of this coroutine itself still propagates from here.
            await asyncio.wait(workers)
        finally:
            if watcher is not None:
                watcher.cancel()
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, *([watcher] if watcher else []), return_exceptions=True)
        for task in workers:
            if not task.cancelled() and (exc := task.exception()) is not None:
                raise exc  # a bug, not a request failure (those become records)
    return [records[pos] for pos in sorted(records)]


async def _watch_cancel(cancel: threading.Event | None, tasks: list[asyncio.Task[None]]) -> None:
    """Poll the thread-safe ``cancel`` event; when set, abort the worker tasks."""
    if cancel is None:
        return
    while not cancel.is_set():
        await asyncio.sleep(_CANCEL_POLL_S)
    for task in tasks:
        task.cancel()


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
        - with at least one successful request: ``request_throughput``
          (req/s), ``output_throughput``, ``total_token_throughput``
          (tokens/s), ``request_goodput`` (req/s; only with SLOs), and
          ``mean_/median_/std_/pNN_`` + ``ttft_ms``, ``tpot_ms``, ``itl_ms``,
          ``e2el_ms`` for each metric that has data. ITL pools the gaps of all
          successful requests; TPOT covers requests with > 1 output token.

    Raises:
        ValueError: ``duration_s`` not a positive finite number, a percentile
            outside [0, 100], or an unknown SLO name.

    Source: ``calculate_metrics`` and ``benchmark`` in vLLM
    ``vllm/benchmarks/serve.py``; see the module docstring for deviations.
    """
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a positive finite number, got {duration_s}")
    percentiles = sorted({50.0, *(float(p) for p in selected_percentiles)})
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ValueError(f"percentiles must be within [0, 100], got {percentiles}")
    slos = dict(goodput_slos_ms or {})
    unknown = set(slos) - set(_SLO_NAMES)
    if unknown:
        raise ValueError(f"unknown SLO names {sorted(unknown)}; valid: {list(_SLO_NAMES)}")

    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.success and r.ttft_s is not None and r.e2el_s is not None]
    total_input = sum(r.prompt_tokens or 0 for r in ok)
    total_output = sum(r.output_tokens or 0 for r in ok)
    out: dict[str, float] = {
        "duration": float(duration_s),
        "completed": float(len(ok)),
        "failed": float(len(measured) - len(ok)),
        "total_input_tokens": float(total_input),
        "total_output_tokens": float(total_output),
    }
    if not ok:
        return out

    out["request_throughput"] = len(ok) / duration_s
    out["output_throughput"] = total_output / duration_s
    out["total_token_throughput"] = (total_input + total_output) / duration_s

    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2els = [r.e2el_s for r in ok if r.e2el_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    itls = [gap for r in ok for gap in r.itl_s]

    if slos:
        good = 0
        for r in ok:
            value_s = {"ttft": r.ttft_s, "tpot": r.tpot_s or 0.0, "e2el": r.e2el_s}
            if all((value_s[k] or 0.0) * 1000.0 <= slo for k, slo in slos.items()):
                good += 1
        out["request_goodput"] = good / duration_s

    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out.update(_stats_ms(name, values, percentiles))
    return out
