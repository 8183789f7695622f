"""Request body limit: bodies above ``settings.limits.max_body_bytes`` are refused unread.

A pure ASGI middleware (outside FastAPI's body parsing, so nothing reads a large body
whole first). A request that declares its ``Content-Length`` above the limit is
answered at once with 413 ``application/problem+json`` (code ``payload_too_large``)
and its body is never read; a chunked body (no ``Content-Length``) is read up to the
limit, and refused the same way as soon as it goes past it. Smaller bodies reach the
app unchanged.

The default (16 MiB, ``VLAB_LIMITS__MAX_BODY_BYTES``) holds every spec but the
largest inline replays: a replay workload may list up to 20,000 request bodies,
about 800 bytes each on average within 16 MiB. A service that replays more or
longer traffic raises the setting; the refusal names it.
"""

from __future__ import annotations

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


def install(app: FastAPI, settings: Settings) -> None:
    """Add the body limit of ``settings.limits`` to ``app``."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_body_bytes)
