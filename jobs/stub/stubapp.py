"""The stub's ASGI application: what :mod:`jobs.stub.stubserver` serves.

Endpoints, timing, capacity mode, prefix cache and noise are described there; this
module answers the requests (streamed or whole, on the timetable) and counts what it
did (:meth:`StubApp.stats`, the ``/metrics`` text).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from jobs.stub.stubengine import PrefixCache, Slots, prompt_token_list

__all__ = ["DEFAULT_MAX_TOKENS", "StubApp"]

DEFAULT_MAX_TOKENS = 16
"""Tokens sent when a request gives neither ``max_completion_tokens`` nor ``max_tokens``."""

_TOKEN_TEXT = " tok"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _max_tokens(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return DEFAULT_MAX_TOKENS


class StubApp:
    """The ASGI application; counters are only touched from the server's event loop."""

    def __init__(
        self,
        ttft_s: float,
        itl_s: float,
        model: str,
        cached_tokens: int,
        *,
        slots: int | None = None,
        noise_s: float = 0.0,
        noise_sigma: float = 0.5,
        seed: int = 0,
        prefix_cache: bool = False,
        reset_keeps_cache: bool = False,
        report_cached_tokens: bool = True,
        block_size: int = 16,
    ) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.model = model
        self.cached_tokens = cached_tokens
        self.prefix_cache = PrefixCache(block_size) if prefix_cache else None
        self.reset_keeps_cache = reset_keeps_cache
        self.report_cached_tokens = report_cached_tokens
        self.slots = Slots(slots) if slots is not None else None
        self.noise_s = noise_s
        self.noise_sigma = noise_sigma
        self._rng = random.Random(seed)
        self.requests = 0
        self.running = 0
        self.max_running = 0
        self.success = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.disconnects = 0
        self.emit_lag_sum_s = 0.0
        self.emit_lag_max_s = 0.0
        self.emits = 0

    def reset(self) -> None:
        """Start a new window for ``max_running``, ``disconnects`` and the emit stats."""
        self.max_running = self.running
        self.disconnects = 0
        self.emits = 0
        self.emit_lag_sum_s = 0.0
        self.emit_lag_max_s = 0.0

    def stats(self) -> dict[str, Any]:
        return {
            "ttft_s": self.ttft_s,
            "itl_s": self.itl_s,
            "slots": self.slots.n if self.slots is not None else None,
            "waiting": len(self.slots.queue) if self.slots is not None else 0,
            "noise_s": self.noise_s,
            "requests": self.requests,
            "running": self.running,
            "max_running": self.max_running,
            "success": self.success,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "disconnects": self.disconnects,
            "emits": self.emits,
            "emit_lag_mean_s": self.emit_lag_sum_s / self.emits if self.emits else 0.0,
            "emit_lag_max_s": self.emit_lag_max_s,
        }

    # -- ASGI ----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not served
        method, path = scope["method"], scope["path"]
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            await self._generate(path == "/v1/completions", receive, send)
        elif method == "GET" and path == "/health":
            await self._respond(send, 200, b"", b"text/plain")
        elif method == "GET" and path == "/v1/models":
            card = {"id": self.model, "object": "model", "created": int(time.time())}
            card.update({"owned_by": "vlab-stub", "root": self.model, "parent": None})
            await self._json(send, 200, {"object": "list", "data": [card]})
        elif method == "GET" and path == "/metrics":
            await self._respond(send, 200, self._metrics_text().encode(), b"text/plain")
        elif method == "POST" and path == "/reset_prefix_cache":
            if self.prefix_cache is not None and not self.reset_keeps_cache:
                self.prefix_cache.clear()
            await self._respond(send, 200, b"", b"text/plain")
        elif method == "GET" and path == "/stub/stats":
            await self._json(send, 200, self.stats())
        elif method == "POST" and path == "/stub/reset":
            self.reset()
            await self._json(send, 200, self.stats())
        else:
            await self._error(send, 404, f"no route for {method} {path}", "NotFoundError")

    async def _respond(self, send: Send, status: int, body: bytes, ctype: bytes) -> None:
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _json(self, send: Send, status: int, obj: Any) -> None:
        await self._respond(send, status, json.dumps(obj).encode(), b"application/json")

    async def _error(self, send: Send, status: int, message: str, kind: str) -> None:
        err = {"message": message, "type": kind, "param": None, "code": status}
        await self._json(send, status, {"error": err})

    def _metrics_text(self) -> str:
        label = f'{{engine="0",model_name="{self.model}"}}'
        lines = []
        running, waiting = self.running, 0
        if self.slots is not None:  # in flight and not queued for a slot (noise included)
            waiting = len(self.slots.queue)
            running = max(0, self.running - waiting)
        for name, kind, value in (
            ("vllm:num_requests_running", "gauge", running),
            ("vllm:num_requests_waiting", "gauge", waiting),
            ("vllm:prompt_tokens", "counter", self.prompt_tokens),
            ("vllm:generation_tokens", "counter", self.generation_tokens),
            ("vllm:request_success", "counter", self.success),
        ):
            sample = f"{name}_total" if kind == "counter" else name
            lines += [f"# HELP {name} stub", f"# TYPE {name} {kind}", f"{sample}{label} {value}.0"]
        if self.prefix_cache is not None:
            lines += self.prefix_cache.metrics_lines(label)
        return "\n".join(lines) + "\n"

    async def _generate(self, completions: bool, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        raw = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        t0 = loop.time()  # the timetable starts when the body has arrived
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body is not a JSON object")
        except ValueError as exc:
            await self._error(send, 400, f"invalid JSON body: {exc}", "BadRequestError")
            return
        n = _max_tokens(body)
        tokens = prompt_token_list(body)
        prompt_tokens = len(tokens)
        if self.prefix_cache is not None:
            cached = self.prefix_cache.lookup_and_insert(tokens)
        else:
            cached = min(self.cached_tokens, prompt_tokens)
        self.requests += 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self.prompt_tokens += prompt_tokens
        try:
            t0 = await self._admit(loop, t0, n)
            if body.get("stream"):
                usage = (body.get("stream_options") or {}).get("include_usage", False)
                await self._stream(
                    completions, body, n, prompt_tokens, cached, usage, t0, receive, send
                )
            else:
                await self._whole(completions, body, n, prompt_tokens, cached, t0, send)
        finally:
            self.running -= 1

    async def _admit(self, loop: asyncio.AbstractEventLoop, t0: float, n: int) -> float:
        """Capacity mode and noise: when the request's timetable starts (``t0`` if neither).

        In capacity mode it waits for a slot and holds it for the fixed service time
        ``ttft_s + (n - 1) * itl_s`` from the moment it got it; the noise delay is added
        after that, outside the slot.
        """
        if self.slots is not None:
            await self.slots.acquire()
            t0 = loop.time()
            loop.call_later(self.ttft_s + max(0, n - 1) * self.itl_s, self.slots.release)
        if self.noise_s > 0:
            t0 += self.noise_s * self._rng.lognormvariate(0.0, self.noise_sigma)
        return t0

    def _usage(self, n: int, prompt_tokens: int, cached: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + n,
            "completion_tokens": n,
        }
        if self.report_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    async def _whole(
        self,
        completions: bool,
        body: dict[str, Any],
        n: int,
        prompt_tokens: int,
        cached: int,
        t0: float,
        send: Send,
    ) -> None:
        loop = asyncio.get_running_loop()
        due = t0 + self.ttft_s + max(0, n - 1) * self.itl_s
        await asyncio.sleep(max(0.0, due - loop.time()))
        text = _TOKEN_TEXT * n
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if completions:
            choice["text"] = text
        else:
            choice["message"] = {"role": "assistant", "content": text}
        obj = {
            "id": f"{'cmpl' if completions else 'chatcmpl'}-{uuid.uuid4().hex}",
            "object": "text_completion" if completions else "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", self.model),
            "choices": [choice],
            "usage": self._usage(n, prompt_tokens, cached),
        }
        self.generation_tokens += n
        self.success += 1
        await self._json(send, 200, obj)

    async def _stream(
        self,
        completions: bool,
        body: dict[str, Any],
        n: int,
        prompt_tokens: int,
        cached: int,
        include_usage: bool,
        t0: float,
        receive: Receive,
        send: Send,
    ) -> None:
        loop = asyncio.get_running_loop()
        head = {
            "id": f"{'cmpl' if completions else 'chatcmpl'}-{uuid.uuid4().hex}",
            "object": "text_completion" if completions else "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model", self.model),
        }

        def chunk(finish: str | None, role: bool = False) -> bytes:
            choice: dict[str, Any] = {"index": 0}
            if completions:
                choice["text"] = _TOKEN_TEXT
            elif role:
                choice["delta"] = {"role": "assistant", "content": ""}
            else:
                choice["delta"] = {"content": _TOKEN_TEXT}
            choice.update({"logprobs": None, "finish_reason": finish})
            if completions:
                choice["stop_reason"] = None
            return _sse({**head, "choices": [choice]})

        token = chunk(None)  # every token chunk but the last is these same bytes
        tail = (chunk("length") if n else b"") + (
            _sse({**head, "choices": [], "usage": self._usage(n, prompt_tokens, cached)})
            if include_usage
            else b""
        )
        tail += b"data: [DONE]\n\n"
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        gone = False

        async def watch_disconnect() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True

        watcher = asyncio.create_task(watch_disconnect())
        try:
            sent = 0
            first_due = t0 + self.ttft_s
            for k in range(n):
                due = first_due + k * self.itl_s
                left = due - loop.time()
                if left > 0:
                    await asyncio.sleep(left)
                if gone:
                    self.disconnects += 1
                    return
                lag = loop.time() - due
                self.emits += 1
                self.emit_lag_sum_s += lag
                if lag > self.emit_lag_max_s:
                    self.emit_lag_max_s = lag
                data = token if k < n - 1 else tail
                if k == 0 and not completions:
                    data = chunk(None, role=True) + data
                await send({"type": "http.response.body", "body": data, "more_body": k < n - 1})
                sent += 1
            if n == 0:
                await asyncio.sleep(max(0.0, first_due - loop.time()))
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            self.generation_tokens += sent
            self.success += 1
        finally:
            watcher.cancel()
