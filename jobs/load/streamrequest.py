"""One streamed request to an OpenAI-compatible server, timed into a ``RequestRecord``.

The body (:func:`_request_body`), the SSE stream parsed line by line where the bytes
arrive (:class:`_StreamParser`) and the record (:func:`one_request`). What the times
mean, and how requests are dispatched: :mod:`jobs.load.loadgen`.
"""

from __future__ import annotations

import asyncio
import errno
import json
import time
from collections.abc import Callable
from typing import Any

from jobs.load.sseclient import ConnectionPool
from jobs.schemas import ChatRequest, RequestRecord

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "CONNECTION_REFUSED",
    "MAX_ERROR_CHARS",
    "one_request",
    "record_fields",
    "refused",
]

CHAT_PATH = "/v1/chat/completions"
"""Path of the OpenAI-compatible chat endpoint, appended to ``base_url``."""

COMPLETIONS_PATH = "/v1/completions"
"""Path of the OpenAI-compatible completions endpoint (requests with a ``prompt``)."""

MAX_ERROR_CHARS = 500
"""A failed record's ``error`` is cut to this many characters."""

#: Body fields ``extra_body`` never overrides: what makes the request streamed and timed,
#: and the request's own typed fields (content and ``max_tokens``).
_PROTECTED_FIELDS = frozenset(
    {"model", "stream", "stream_options", "messages", "prompt", "max_tokens"}
)

CONNECTION_REFUSED = "connection refused"
"""Start of a failed record's ``error`` when the server's port refused the connection."""


def _is_refused(exc: BaseException) -> bool:
    if isinstance(exc, ConnectionRefusedError):
        return True
    return isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED


def refused(record: RequestRecord) -> bool:
    """Whether ``record`` failed because nothing listened on the server's port any more.

    The first sign of a dead server: pass it as :func:`jobs.load.loadgen.run_load`'s ``stop_when``.
    """
    return not record.success and (record.error or "").startswith(CONNECTION_REFUSED)


def _json_bytes(body: dict[str, Any]) -> bytes:
    """``body`` as compact JSON; NaN and infinity are refused (ValueError), as not JSON."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class _RequestFailed(Exception):
    """A request failed in a way the stream itself reported (status, error chunk)."""


def _request_body(model: str, request: ChatRequest) -> dict[str, Any]:
    """The streamed OpenAI body of ``request``: completions when it has a ``prompt``, else chat.

    ``extra_body`` is merged over the defaults (``ignore_eos`` true, ``temperature``
    0) but never over :data:`_PROTECTED_FIELDS`.
    """
    body: dict[str, Any] = {"model": model}
    if request.prompt is not None:
        body["prompt"] = request.prompt
    else:
        body["messages"] = request.messages
    body.update(
        {
            "max_tokens": request.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "temperature": 0,
        }
    )
    for key, value in request.extra_body.items():
        if key not in _PROTECTED_FIELDS:
            body[key] = value
    return body


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text}"[:MAX_ERROR_CHARS] if text else name


_JSON_DECODER = json.JSONDecoder()


def _json_loads(payload: bytes) -> Any:
    """``json.loads`` of a UTF-8 payload without leading whitespace, minus its per-call
    encoding detection (a few µs per streamed chunk). Raises ValueError as it does."""
    text = payload.decode()
    value, end = _JSON_DECODER.raw_decode(text)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def _chunk_text(chunk: dict[str, Any], completions: bool) -> str:
    """Content of a stream chunk, ``""`` when absent or malformed.

    ``choices[0].text`` for completions, ``choices[0].delta.content`` for chat.
    """
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    if completions:
        text = choices[0].get("text")
    else:
        delta = choices[0].get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
    return text if isinstance(text, str) else ""


class _StreamParser:
    """Timing and usage of one SSE stream, fed line by line (bytes, without the newline)."""

    __slots__ = (
        "completions",
        "done",
        "first",
        "last",
        "itl",
        "content_chunks",
        "prompt_tokens",
        "output_tokens",
        "cached_tokens",
    )

    def __init__(self, completions: bool) -> None:
        self.completions = completions
        self.done = False  # [DONE] seen: later lines are ignored
        self.first: float | None = None  # arrival of the first content chunk
        self.last: float | None = None  # arrival of the latest content chunk
        self.itl: list[float] = []
        self.content_chunks = 0
        self.prompt_tokens: int | None = None
        self.output_tokens: int | None = None
        self.cached_tokens: int | None = None

    def feed(self, line: bytes, now: float) -> None:
        """Take one line that arrived at ``now`` (``time.perf_counter()``).

        Raises:
            _RequestFailed: an error chunk.
            ValueError, TypeError: bad JSON, or a malformed ``usage``.
        """
        if self.done or not line.startswith(b"data:"):
            return  # blank separators, SSE comments (":ping"), event/id fields
        payload = line[5:].strip()
        if not payload:
            return
        if payload == b"[DONE]":
            self.done = True
            return
        chunk = _json_loads(payload)
        if not isinstance(chunk, dict):
            return
        if chunk.get("error") or chunk.get("object") == "error":
            # vLLM streams errors as {"error": {...}} (newer) or {"object": "error", ...}
            raise _RequestFailed(f"error chunk: {json.dumps(chunk)}")
        if _chunk_text(chunk, self.completions):
            self.content_chunks += 1
            if self.first is None:
                self.first = now
            elif self.last is not None:
                self.itl.append(now - self.last)
            self.last = now
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if usage.get("prompt_tokens") is not None:
                self.prompt_tokens = int(usage["prompt_tokens"])
            if usage.get("completion_tokens") is not None:
                self.output_tokens = int(usage["completion_tokens"])
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                self.cached_tokens = int(details["cached_tokens"])


def record_fields(
    request: ChatRequest, start_s: float, scheduled_s: float | None
) -> dict[str, Any]:
    """The :class:`RequestRecord` fields copied from the request and the dispatch."""
    return {
        "index": request.index,
        "warmup": request.warmup,
        "request_class": request.request_class,
        "start_s": start_s,
        "scheduled_s": scheduled_s,
        "conversation": request.conversation,
        "turn": request.turn,
    }


async def one_request(
    pool: ConnectionPool,
    model: str,
    request: ChatRequest,
    *,
    timeout_s: float,
    origin: float,
    scheduled_s: float | None,
    on_start: Callable[[float], None] | None = None,
) -> RequestRecord:
    """Send one streamed request and time it; never raises for request errors.

    ``on_start`` gets the ``time.perf_counter()`` value the timing starts from.
    """
    completions = request.prompt is not None
    body = _request_body(model, request)
    start = time.perf_counter()
    if on_start is not None:
        on_start(start)
    parser = _StreamParser(completions)
    error: str | None = None
    try:
        async with asyncio.timeout(timeout_s):
            data = _json_bytes(body)  # in the try: a body that is not JSON fails the request
            # each line reaches the parser when the read that brought its end arrives; the
            # body is read to its end (after [DONE] too), so the connection is kept alive
            path = COMPLETIONS_PATH if completions else CHAT_PATH
            resp = await pool.post(path, data, parser.feed)
            if resp.status != 200:
                detail = resp.body.decode("utf-8", "replace").strip()
                raise _RequestFailed(f"HTTP {resp.status}: {detail}")
    except _RequestFailed as exc:
        error = str(exc)[:MAX_ERROR_CHARS]
    except TimeoutError:
        error = f"timeout after {timeout_s:g} s"
    except (OSError, ValueError, TypeError) as exc:  # refused, cut, bad JSON or usage
        error = _error_text(exc)
        if _is_refused(exc):
            error = f"{CONNECTION_REFUSED}: {error}"[:MAX_ERROR_CHARS]

    fields = record_fields(request, start - origin, scheduled_s)
    first, last = parser.first, parser.last
    if error is None and (first is None or last is None):
        error = "stream ended without any content chunk"
    if error is not None:
        return RequestRecord(
            success=False,
            error=error,
            prompt_tokens=parser.prompt_tokens,
            cached_tokens=parser.cached_tokens,
            **fields,
        )
    assert first is not None and last is not None
    output_tokens = parser.output_tokens
    if output_tokens is None:
        output_tokens = parser.content_chunks
    ttft = first - start
    e2el = last - start
    tpot = (e2el - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    return RequestRecord(
        success=True,
        ttft_s=ttft,
        itl_s=parser.itl,
        tpot_s=tpot,
        e2el_s=e2el,
        prompt_tokens=parser.prompt_tokens,
        output_tokens=output_tokens,
        cached_tokens=parser.cached_tokens,
        **fields,
    )
