"""Request limits: bodies above ``settings.limits.max_body_bytes`` are refused unread, and
at most ``settings.api.max_concurrent_reads`` reads are inside the application at once.

Body limit: a pure ASGI middleware (outside FastAPI's body parsing, so nothing reads a large body
whole first). A request that declares its ``Content-Length`` above the limit is
answered at once with 413 ``application/problem+json`` (code ``payload_too_large``)
and its body is never read; a chunked body (no ``Content-Length``) is read up to the
limit, and refused the same way as soon as it goes past it. Smaller bodies reach the
app unchanged.

The default (16 MiB, ``VLAB_LIMITS__MAX_BODY_BYTES``) holds every spec but the
largest inline replays: a replay workload may list up to 20,000 request bodies,
about 800 bytes each on average within 16 MiB. A service that replays more or
longer traffic raises the setting; the refusal names it.

Read admission: at most ``settings.api.max_concurrent_reads`` GET/HEAD requests are
inside the application at once (:class:`ReadGateMiddleware`); the others wait, in the
order they came, on the event loop, holding no worker thread and no database
connection. Without it, every concurrent reader took a worker thread (40) and a pooled
connection (a sync route's dependencies and body run in separate threadpool calls while
the connection stays checked out); past the pool's size, threads blocked in checkout
while the requests holding connections waited for a thread: at 64 concurrent readers
35-40 % answered 503 ``database_busy`` after the 10 s pool timeout (docs/BENCHMARKS.md),
and the dispatcher of the same process checks out from that pool too. With the gate the
reads hold at most ``max_concurrent_reads`` of its 40 connections. ``/healthz``,
``/metrics`` and ``/static`` are not gated (a
probe answers during a read storm); writes are not gated (the submissions have a gate of
their own, :mod:`orchestrator.experiments.config_check`, and a write must not wait
behind reads).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.core.settings import Settings

SETTING = "VLAB_LIMITS__MAX_BODY_BYTES"


class BodyLimitMiddleware:
    """Refuse HTTP request bodies longer than ``max_bytes`` with 413 problem+json."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = -1  # the HTTP server refuses a malformed length itself
            if size > self.max_bytes:
                await self._refuse(scope, send, f"the request body is {size} bytes")
                return
            await self.app(scope, receive, send)
            return
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            await self.app(scope, receive, send)  # no body
            return
        # chunked: read up to the limit, then hand the body on (or refuse it)
        buffered: list[Message] = []
        total = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                await self._refuse(scope, send, f"the request body exceeds {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, what: str) -> None:
        body: dict[str, Any] = {
            "type": "https://vlab.dev/problems/payload-too-large",
            "title": "Request body too large",
            "status": 413,
            "detail": f"{what}; the API accepts at most {self.max_bytes} bytes "
            f"(an operator can raise {SETTING})",
            "instance": scope.get("path", ""),
            "code": "payload_too_large",
            "max_bytes": self.max_bytes,
        }
        raw = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/problem+json"),
                    (b"content-length", str(len(raw)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": raw})


#: Paths that are never gated: probes, the scrape, static assets (no database).
UNGATED = ("/healthz", "/metrics", "/static/")
_READS = frozenset({"GET", "HEAD"})


class ReadGateMiddleware:
    """Let at most ``max_reads`` GET/HEAD requests into ``app`` at once; the rest wait
    first come, first served (an :class:`asyncio.Semaphore` of the running loop)."""

    def __init__(self, app: ASGIApp, max_reads: int) -> None:
        self.app = app
        self.max_reads = max_reads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots = asyncio.Semaphore(max_reads)

    def _gate(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new server loop (tests start one per client)
            self._loop, self._slots = loop, asyncio.Semaphore(self.max_reads)
        return self._slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") not in _READS
            or scope.get("path", "").startswith(UNGATED)
        ):
            await self.app(scope, receive, send)
            return
        async with self._gate():
            await self.app(scope, receive, send)


def install(app: FastAPI, settings: Settings) -> None:
    """Add the read gate of ``settings.api`` and the body limit of ``settings.limits``
    (outermost) to ``app``."""
    app.add_middleware(ReadGateMiddleware, max_reads=settings.api.max_concurrent_reads)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_body_bytes)
