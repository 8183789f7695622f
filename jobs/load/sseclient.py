"""The load generator's HTTP/1.1 transport: streamed POSTs on asyncio protocols, lines timed.

Why not aiohttp (which ``vllm bench serve`` uses, and :mod:`jobs.load.loadgen` used before):
a streamed response there passes every network read through a stream reader and wakes
the request's task to read it; at 64 tokens a request that is ~90 Python calls per token,
and most of the client's CPU (profiled: 2.1 ms of CPU per request at 100 requests/s
against the stub, 1.4 ms with this transport, same machine, same run). Here the
response is parsed where the bytes arrive (:meth:`asyncio.Protocol.data_received`) by
``httptools.HttpResponseParser`` (llhttp, the parser uvicorn uses: status line,
headers, chunked, ``Content-Length`` or until-close framing), whose callbacks hand the
body's bytes over as they come; each complete line of a 200 response goes to the
caller's ``on_line(line, now)`` at once, ``now`` being the ``time.perf_counter()`` of
the read that brought the line's end (lines that arrive in one read arrive together).
The request's task wakes once, when the response has ended.

What it does, and no more: plain ``http://`` (no TLS, no proxies, no redirects), one
request at a time per connection, keep-alive connections reused LIFO by a
:class:`ConnectionPool` (TCP_NODELAY: asyncio sets it on every TCP connection it
opens). A connection the server closed while idle is skipped; a request whose reused
connection closes before any byte of the response came back is sent once more on a
new connection (the server closed it while the request was on its way, as HTTP
clients do for keep-alive races). Any other failure raises:

- ``OSError`` from connecting (``ConnectionRefusedError`` when nothing listens);
- :class:`ServerDisconnected` when the connection closes before the response ended;
- :class:`BadResponse` for a response that is not HTTP/1.x or has bad framing;
- whatever ``on_line`` raises (the connection is then closed, the rest unread).

A response that is not 200 is read whole and returned (status and body), not streamed.
A cancelled request (timeout, abort) closes its connection.

:func:`last_bytes_at` says when a server last sent this process a byte, over any of its
connections: a stream still moving says the server is alive (:mod:`jobs.run.enginewatch`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

__all__ = ["BadResponse", "ConnectionPool", "Response", "ServerDisconnected", "last_bytes_at"]

_MAX_HEAD = 64 * 1024  # a status line and headers longer than this are refused
_MAX_ERROR_BODY = 1024 * 1024  # a non-200 body is kept up to this many bytes
#: (host, port) -> ``time.perf_counter()`` of the last read that brought bytes from it
_last_bytes: dict[tuple[str, int], float] = {}


def last_bytes_at(base_url: str) -> float | None:
    """``time.perf_counter()`` of the last read that brought this process bytes from the
    server at ``base_url`` (``http://host:port``), over any connection; None if none."""
    parts = urlsplit(base_url)
    return _last_bytes.get((parts.hostname or "", parts.port or 80))


class ServerDisconnected(ConnectionError):
    """The connection closed before the response ended."""


class BadResponse(ValueError):
    """The server's bytes are not an HTTP/1.x response this client understands."""


class Response:
    """Status and (for a status other than 200) body of a finished response."""

    __slots__ = ("body", "status")

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request in flight at most.

    It is also the protocol of its request's :class:`httptools.HttpResponseParser`
    (the ``on_*`` methods below are that parser's callbacks, called from ``feed_data``
    inside :meth:`data_received`).
    """

    def __init__(self, server: tuple[str, int] = ("", 0)) -> None:
        self.server = server  # (host, port): the key of :func:`last_bytes_at`
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.keep_alive = True
        self._done: asyncio.Future[Response] | None = None
        self._on_line: Callable[[bytes, float], None] | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._now = 0.0  # perf_counter of the read being parsed
        self._head = True  # the final response's head has not ended yet
        self._framed = False  # it has a Content-Length or a chunked Transfer-Encoding
        self._line: list[bytes] = []  # start of a body line whose end has not arrived
        self._status = 0
        self._error_body: list[bytes] = []
        self._error_size = 0
        self.received = 0  # bytes of the current response

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._done is None or self._done.done():
            return
        if not self._head and not self._framed:
            # a body delimited by the close (httptools has no call for llhttp_finish,
            # so the end of such a body is told here, from the head's framing headers)
            self._end(time.perf_counter())
            return
        self._fail(
            ServerDisconnected(
                f"response payload is not completed: the connection closed after "
                f"{self.received} bytes of the response" + (f" ({exc})" if exc else "")
            )
        )

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def data_received(self, data: bytes) -> None:
        self._now = _last_bytes[self.server] = time.perf_counter()
        parser = self._parser
        if parser is None or self._done is None or self._done.done():
            self.abort()  # bytes outside a request: nothing sane to do with them
            return
        self.received += len(data)
        try:
            parser.feed_data(data)
            if self._head and self.received > _MAX_HEAD:
                raise BadResponse("response head too long")
        except httptools.HttpParserCallbackError as exc:
            # one of the callbacks below raised (on_line's own error: bad JSON, an error
            # chunk); httptools keeps it as the context
            self._fail(exc.__context__ or BadResponse(str(exc)))
            self.abort()
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(BadResponse(f"bad HTTP/1.x response: {exc}"))
            self.abort()
        except Exception as exc:  # raised by us outside a parser callback
            self._fail(exc)
            self.abort()

    # -- httptools.HttpResponseParser callbacks --------------------------------------

    def on_message_begin(self) -> None:
        if self._done is not None and self._done.done():
            raise BadResponse("bytes after the end of the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (
            name == b"transfer-encoding" and value.rstrip().lower().endswith(b"chunked")
        ):
            self._framed = True

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim response (100 Continue): the real one follows
            self._framed = False
            return
        self._status = status
        self._head = False
        self.keep_alive = self._parser.should_keep_alive()

    def on_body(self, data: bytes) -> None:
        self._body(data, self._now)

    def on_message_complete(self) -> None:
        if self._head:  # the end of an interim response
            return
        assert self._parser is not None
        self.keep_alive = self._parser.should_keep_alive()
        self._end(self._now)

    # -- one request -----------------------------------------------------------------

    def send(
        self, request: bytes, on_line: Callable[[bytes, float], None]
    ) -> asyncio.Future[Response]:
        assert self.transport is not None
        assert self._done is None or self._done.done()
        self._done = asyncio.get_running_loop().create_future()
        self._on_line = on_line
        self._parser = httptools.HttpResponseParser(self)
        self._head = True
        self._framed = False
        self._status = 0
        self._line = []
        self._error_body = []
        self._error_size = 0
        self.received = 0
        self.transport.write(request)
        return self._done

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: BaseException) -> None:
        self.keep_alive = False
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)

    def _end(self, now: float) -> None:
        if self._line and self._status == 200:
            assert self._on_line is not None
            self._on_line(b"".join(self._line), now)
        self._line = []
        if self._done is not None and not self._done.done():
            self._done.set_result(Response(self._status, b"".join(self._error_body)))

    def _body(self, data: bytes, now: float) -> None:
        if not data:
            return
        if self._status != 200:
            if self._error_size < _MAX_ERROR_BODY:
                self._error_body.append(data)
                self._error_size += len(data)
            return
        line = self._line
        if b"\n" not in data:
            line.append(data)
            return
        if line:
            line.append(data)
            data = b"".join(line)
            line.clear()
        lines = data.split(b"\n")
        if tail := lines.pop():
            line.append(tail)
        on_line = self._on_line
        assert on_line is not None
        for one in lines:
            if one:  # not the blank line between events
                on_line(one, now)


class ConnectionPool:
    """Keep-alive connections to one ``http://host:port`` server.

    Args:
        base_url: ``http://host[:port]`` (a path after it is ignored).

    Raises:
        ValueError: not an ``http://`` URL.
    """

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the load generator speaks plain http://, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        self._host_header = f"{netloc}:{self.port}".encode()
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        server = (self.host, self.port)
        _, conn = await loop.create_connection(lambda: _Connection(server), self.host, self.port)
        self._all.add(conn)
        return conn

    def _request(self, path: str, body: bytes) -> bytes:
        return (
            b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + self._host_header
            + b"\r\nContent-Type: application/json\r\nAccept: */*\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body
        )  # fmt: skip

    async def post(
        self, path: str, body: bytes, on_line: Callable[[bytes, float], None]
    ) -> Response:
        """POST ``body`` (JSON) to ``path``; each line of a 200 response goes to ``on_line``.

        Returns once the response has ended. Raises as the module docstring says.
        """
        request = self._request(path, body)
        while self._idle:
            conn = self._idle.pop()
            if conn.closed:
                self._all.discard(conn)
                continue
            try:
                return await self._exchange(conn, request, on_line)
            except ServerDisconnected:
                if conn.received:
                    raise
                # the server closed this idle connection as our request went out: once more
                break
        return await self._exchange(await self._connect(), request, on_line)

    async def _exchange(
        self, conn: _Connection, request: bytes, on_line: Callable[[bytes, float], None]
    ) -> Response:
        done = conn.send(request, on_line)
        try:
            response = await done
        except BaseException:
            conn.abort()
            self._all.discard(conn)
            raise
        if conn.keep_alive and not conn.closed:
            self._idle.append(conn)
        else:
            conn.abort()
            self._all.discard(conn)
        return response

    def close(self) -> None:
        """Close every connection (requests still in flight fail)."""
        for conn in self._all:
            conn.abort()
        self._all.clear()
        self._idle.clear()

    async def __aenter__(self) -> ConnectionPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
