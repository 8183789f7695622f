"""Tests of jobs.load.sseclient: HTTP/1.1 framing, lines timed on arrival, keep-alive and its races.

The parser is fed byte strings directly (every split of a response into two reads gives
the same lines); the pool runs against small asyncio servers on 127.0.0.1 that answer
with scripted bytes.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from jobs.load.sseclient import (
    BadResponse,
    ConnectionPool,
    Response,
    ServerDisconnected,
    _Connection,
)

SSE_LINES = [b'data: {"n":1}', b'data: {"n":2}', b"data: [DONE]"]
SSE_BODY = b"".join(line + b"\n\n" for line in SSE_LINES)


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    out, pos = b"", 0
    for size in sizes:
        part = body[pos : pos + size]
        out += f"{len(part):x}\r\n".encode() + part + b"\r\n"
        pos += size
    return out + b"0\r\n\r\n"


CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + _chunked(SSE_BODY, [len(SSE_LINES[0]) + 2, 5, len(SSE_BODY)])
)


class _FakeTransport:
    def __init__(self) -> None:
        self.written = b""
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written += data

    def abort(self) -> None:
        self.aborted = True


def _feed(*reads: bytes) -> tuple[asyncio.Future[Response], list[bytes], _Connection]:
    """A connection fed ``reads`` after one request; the future, the lines it gave, it."""
    lines: list[bytes] = []
    conn = _Connection()
    conn.transport = _FakeTransport()  # type: ignore[assignment]
    done = conn.send(b"POST / HTTP/1.1\r\n\r\n", lambda line, now: lines.append(line))
    for data in reads:
        conn.data_received(data)
    return done, lines, conn


def _run(coro: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(coro())  # type: ignore[arg-type]


def test_every_split_of_a_chunked_stream_gives_the_same_lines() -> None:
    async def go() -> None:
        for cut in range(1, len(CHUNKED)):
            done, lines, conn = _feed(CHUNKED[:cut], CHUNKED[cut:])
            assert done.done() and done.result().status == 200, cut
            assert lines == SSE_LINES, cut
            assert conn.keep_alive and not conn.transport.aborted  # type: ignore[union-attr]

    _run(go)


def test_framings_other_than_chunked() -> None:
    async def go() -> None:
        # Content-Length, an error status: the body comes back whole, no lines
        body = b'{"error": "boom"}'
        head = f"HTTP/1.1 500 Internal\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        done, lines, _ = _feed(head + body[:5], body[5:])
        assert done.result().status == 500 and done.result().body == body and lines == []
        # an interim 100 Continue before the response, then a length-delimited stream
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(SSE_BODY)}\r\n\r\n".encode()
        done, lines, _ = _feed(b"HTTP/1.1 100 Continue\r\n\r\n" + head + SSE_BODY)
        assert done.result().status == 200 and lines == SSE_LINES
        # no length, not chunked: until the server closes; HTTP/1.0 is not kept alive
        done, lines, conn = _feed(b"HTTP/1.0 200 OK\r\n\r\n" + SSE_BODY + b"data: tail")
        assert not done.done() and not conn.keep_alive
        conn.connection_lost(None)
        assert done.result().status == 200 and lines == [*SSE_LINES, b"data: tail"]
        # 204: no body; trailers after the last chunk are skipped
        done, _, _ = _feed(b"HTTP/1.1 204 No Content\r\n\r\n")
        assert done.result().status == 204
        trailer = CHUNKED[: -len(b"\r\n")] + b"X-Trailer: 1\r\n\r\n"
        done, lines, _ = _feed(trailer)
        assert done.result().status == 200 and lines == SSE_LINES

    _run(go)


@pytest.mark.parametrize(
    "reply",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
    ],
)
def test_bad_framing_fails_the_request_and_closes(reply: bytes) -> None:
    async def go() -> None:
        done, _, conn = _feed(reply)
        with pytest.raises(BadResponse):
            done.result()
        assert conn.transport.aborted  # type: ignore[union-attr]

    _run(go)


def test_bytes_after_a_complete_response_close_the_connection() -> None:
    async def go() -> None:
        done, _, conn = _feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA")
        assert done.result().status == 200  # that response was whole
        assert conn.transport.aborted  # type: ignore[union-attr]  # never reused

    _run(go)


def test_a_second_response_in_the_same_read_closes_the_connection() -> None:
    async def go() -> None:
        one = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        done, _, conn = _feed(one + b"HTTP/1.1 2")  # a valid start: the parser would wait
        assert done.result().status == 200
        assert conn.transport.aborted  # type: ignore[union-attr]

    _run(go)


def test_a_close_ends_only_a_body_that_has_no_framing() -> None:
    async def go() -> None:
        # Connection: close with a Content-Length or chunks: a close before their end is
        # a disconnection, not the end of the body
        for head in (b"Content-Length: 100", b"Transfer-Encoding: chunked"):
            reply = b"HTTP/1.1 200 OK\r\nConnection: close\r\n" + head + b"\r\n\r\n"
            body = b"data: a\n\n" if b"Length" in head else b"9\r\ndata: a\n\n\r\n"
            done, lines, conn = _feed(reply + body)
            assert not done.done() and not conn.keep_alive
            conn.connection_lost(None)
            with pytest.raises(ServerDisconnected, match="not completed"):
                done.result()
            assert lines == [b"data: a"]
        # a close before the head ended
        done, _, conn = _feed(b"HTTP/1.1 200 OK\r\nContent-")
        conn.connection_lost(None)
        with pytest.raises(ServerDisconnected):
            done.result()

    _run(go)


def test_a_head_longer_than_the_limit_is_refused() -> None:
    async def go() -> None:
        long_header = b"X-Big: " + b"a" * 70_000 + b"\r\n"
        done, _, conn = _feed(b"HTTP/1.1 200 OK\r\n", long_header)
        with pytest.raises(BadResponse, match="head too long"):
            done.result()
        assert conn.transport.aborted  # type: ignore[union-attr]
        # a long body in the head's read is not a long head
        body = b"x" * 70_000
        head = f"HTTP/1.1 500 Err\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        done, _, _ = _feed(head + body)
        assert done.result().status == 500 and done.result().body == body

    _run(go)


def test_an_exception_of_on_line_fails_the_request() -> None:
    async def go() -> None:
        conn = _Connection()
        conn.transport = _FakeTransport()  # type: ignore[assignment]

        def on_line(line: bytes, now: float) -> None:
            raise ValueError("bad JSON")

        done = conn.send(b"x", on_line)
        conn.data_received(CHUNKED)
        with pytest.raises(ValueError, match="bad JSON"):
            done.result()
        assert not conn.keep_alive

    _run(go)


# ------------------------------------------------------------------- against servers

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bool:
    """Read one request (head and Content-Length body); False at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return False
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    await reader.readexactly(length)
    return True


async def _serve(handler: Handler, client: Callable[[str], Awaitable[Any]]) -> Any:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        return await client(f"http://127.0.0.1:{port}")


@pytest.mark.timing
def test_lines_are_timed_when_they_arrive_and_connections_are_kept_alive() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while await _read_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for line in SSE_LINES:
                writer.write(_chunked(line + b"\n\n", [len(line) + 2])[:-5])
                await writer.drain()
                await asyncio.sleep(0.05)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    async def client(url: str) -> list[list[tuple[bytes, float]]]:
        out = []
        async with ConnectionPool(url) as pool:
            for _ in range(3):
                got: list[tuple[bytes, float]] = []
                resp = await pool.post(
                    "/v1/x", b"{}", lambda *line_now, got=got: got.append(line_now)
                )
                assert resp.status == 200
                out.append(got)
        return out

    runs = _run(lambda: _serve(handler, client))
    assert connections == 1  # three requests, one kept-alive connection
    for got in runs:
        assert [line for line, _ in got] == SSE_LINES
        gaps = [b - a for (_, a), (_, b) in zip(got, got[1:], strict=False)]
        assert all(gap >= 0.045 for gap in gaps), gaps


def test_a_keep_alive_connection_closed_under_a_request_is_retried_once() -> None:
    served = 0

    async def one_per_connection(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        # answers the first request of a connection; reads the second and closes silently
        nonlocal served
        if await _read_request(reader):
            served += 1
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await w.drain()
        await _read_request(reader)
        w.close()

    async def client(url: str) -> list[int]:
        async with ConnectionPool(url) as pool:
            return [(await pool.post("/", b"{}", lambda *_: None)).status for _ in range(3)]

    assert _run(lambda: _serve(one_per_connection, client)) == [200, 200, 200]
    assert served == 3

    async def never(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        w.close()

    async def fails(url: str) -> None:
        async with ConnectionPool(url) as pool:
            await pool.post("/", b"{}", lambda *_: None)

    with pytest.raises(ServerDisconnected, match="not completed"):
        _run(lambda: _serve(never, fails))


def test_a_server_that_dies_mid_stream_or_is_not_there() -> None:
    async def half(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        partial = _chunked(SSE_BODY, [len(SSE_BODY)])[:20]  # a chunk cut in its data
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + partial)
        await w.drain()
        w.transport.abort()

    async def client(url: str) -> None:
        async with ConnectionPool(url) as pool:
            await pool.post("/", b"{}", lambda *_: None)

    with pytest.raises(ServerDisconnected, match="not completed"):
        _run(lambda: _serve(half, client))

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        _run(lambda: client(f"http://127.0.0.1:{port}"))
    with pytest.raises(ValueError, match="http://"):
        ConnectionPool("https://example.com")


@pytest.mark.timing
def test_a_cancelled_request_closes_its_connection() -> None:
    async def slow(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await w.drain()
        await reader.read()  # until the client closes
        w.close()

    async def client(url: str) -> float:
        async with ConnectionPool(url) as pool:
            t0 = time.perf_counter()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await pool.post("/", b"{}", lambda *_: None)
            assert not pool._idle and not pool._all
            return time.perf_counter() - t0

    assert _run(lambda: _serve(slow, client)) < 2.0
