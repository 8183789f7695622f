"""The load generator's HTTP/1.1 transport: streamed POSTs on asyncio protocols, lines timed.

Why not aiohttp (which ``vllm bench serve`` uses, and :mod:`jobs.loadgen` used before):
a streamed response there passes every network read through a stream reader and wakes
the request's task to read it; at 64 tokens a request that is ~90 Python calls per token,
and most of the client's CPU (profiled: 2.1 ms of CPU per request at 100 requests/s
against the stub, 1.4 ms with this transport, same machine, same run). Here the
response is parsed where the bytes arrive (:meth:`asyncio.Protocol.data_received`):
the status line and headers once, then the body's framing (chunked, ``Content-Length``
or until close), and each complete line of a 200 response goes to the caller's
``on_line(line, now)`` at once, ``now`` being the ``time.perf_counter()`` of the read
that brought the line's end (lines that arrive in one read arrive together). The
request's task wakes once, when the response has ended.

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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit

__all__ = ["BadResponse", "ConnectionPool", "Response", "ServerDisconnected"]

_MAX_HEAD = 64 * 1024  # a status line and headers longer than this are refused
_MAX_ERROR_BODY = 1024 * 1024  # a non-200 body is kept up to this many bytes

# body framing / parser states
_HEAD, _SIZE, _DATA, _DATA_END, _TRAILER, _LENGTH, _UNTIL_CLOSE, _DONE = range(8)


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
    """One keep-alive connection; one request in flight at most."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.keep_alive = True
        self._done: asyncio.Future[Response] | None = None
        self._on_line: Callable[[bytes, float], None] | None = None
        self._state = _DONE
        self._buf = b""  # bytes of the head or a size line not yet complete
        self._left = 0  # bytes left in the current chunk / Content-Length body
        self._line: list[bytes] = []  # start of a body line whose end has not arrived
        self._status = 0
        self._error_body: list[bytes] = []
        self.received = 0  # bytes of the current response

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._done is None or self._done.done():
            return
        if self._state == _UNTIL_CLOSE:
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
        now = time.perf_counter()
        if self._done is None or self._done.done():
            self.abort()  # bytes outside a request: nothing sane to do with them
            return
        self.received += len(data)
        try:
            self._parse(data, now)
        except Exception as exc:  # framing errors, or on_line's own (bad JSON, error chunk)
            self._fail(exc)
            self.abort()

    # -- one request -----------------------------------------------------------------

    def send(
        self, request: bytes, on_line: Callable[[bytes, float], None]
    ) -> asyncio.Future[Response]:
        assert self.transport is not None and self._state == _DONE
        self._done = asyncio.get_running_loop().create_future()
        self._on_line = on_line
        self._state = _HEAD
        self._buf = b""
        self._line = []
        self._error_body = []
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
        self._state = _DONE
        if self._done is not None and not self._done.done():
            self._done.set_result(Response(self._status, b"".join(self._error_body)))

    # -- parsing -----------------------------------------------------------------------

    def _parse(self, data: bytes, now: float) -> None:
        if self._buf:
            data, self._buf = self._buf + data, b""
        pos, end = 0, len(data)
        while pos < end:
            state = self._state
            if state in (_DATA, _LENGTH):
                take = min(self._left, end - pos)
                self._body(data[pos : pos + take], now)
                pos += take
                self._left -= take
                if self._left == 0:
                    if state == _LENGTH:
                        self._end(now)
                    else:
                        self._state = _DATA_END
                continue
            if state == _UNTIL_CLOSE:
                self._body(data[pos:], now)
                return
            if state == _DONE:
                raise BadResponse("bytes after the end of the response")
            if state == _HEAD:
                stop = data.find(b"\r\n\r\n", pos)
                if stop < 0:
                    if end - pos > _MAX_HEAD:
                        raise BadResponse("response head too long")
                    self._buf = data[pos:]
                    return
                self._head(data[pos:stop])
                pos = stop + 4
                continue
            # a line: a chunk size, the CRLF after a chunk's data, or a trailer line
            stop = data.find(b"\r\n", pos)
            if stop < 0:
                if end - pos > _MAX_HEAD:
                    raise BadResponse("chunk size line too long")
                self._buf = data[pos:]
                return
            line = data[pos:stop]
            pos = stop + 2
            if state == _DATA_END:
                if line:
                    raise BadResponse("chunk data longer than its size")
                self._state = _SIZE
            elif state == _SIZE:
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise BadResponse(f"bad chunk size {line[:40]!r}") from None
                if size < 0:
                    raise BadResponse(f"bad chunk size {line[:40]!r}")
                if not size:
                    self._state = _TRAILER
                elif data[pos + size : pos + size + 2] == b"\r\n":  # the whole chunk is here
                    self._body(data[pos : pos + size], now)
                    pos += size + 2
                else:
                    self._left = size
                    self._state = _DATA
            elif not line:  # _TRAILER: the blank line that ends the message
                self._end(now)

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:  # an interim response (100 Continue): the real one follows
            return
        self._status = status
        length: int | None = None
        chunked = False
        self.keep_alive = parts[0] != b"HTTP/1.0"
        for raw in lines[1:]:
            name, sep, value = raw.partition(b":")
            if not sep:
                raise BadResponse(f"bad header line {raw[:80]!r}")
            key = name.strip().lower()
            value = value.strip().lower()
            if key == b"content-length":
                if not value.isdigit():
                    raise BadResponse(f"bad Content-Length {value[:40]!r}")
                length = int(value)
            elif key == b"transfer-encoding":
                chunked = value.endswith(b"chunked")
            elif key == b"connection":
                self.keep_alive = value != b"close"
        if chunked:
            self._state = _SIZE
        elif status in (204, 304) or length == 0:
            self._end(time.perf_counter())
        elif length is not None:
            self._left = length
            self._state = _LENGTH
        else:
            self.keep_alive = False
            self._state = _UNTIL_CLOSE

    def _body(self, data: bytes, now: float) -> None:
        if not data:
            return
        if self._status != 200:
            if sum(map(len, self._error_body)) < _MAX_ERROR_BODY:
                self._error_body.append(data)
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
        _, conn = await loop.create_connection(_Connection, self.host, self.port)
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
