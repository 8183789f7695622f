"""Tests of jobs.load.loadgen: summary maths by hand, and run_load against fake vLLM servers.

Two test doubles of vLLM's OpenAI-compatible server are used, both real HTTP
servers on 127.0.0.1 (a free port):

- ``FakeVllmChatServer`` below (starlette under uvicorn): ``POST
  /v1/chat/completions`` and ``/v1/completions`` with ``stream: true``, streaming
  SSE chunks shaped like vLLM's (for chat a role-only first chunk with empty
  content; one chunk per token, a trailing ``usage`` chunk with empty
  ``choices``, then ``data: [DONE]``) with known sleeps. Each request's last user
  message (or ``prompt``) is a JSON script telling the double how to behave; it
  records the bodies it got. For body shapes and failure modes.
- :class:`jobs.stub.stubserver.StubServer`, the project's stub of "a GPU server with
  known timing" (fixed TTFT and inter-token delay), for dispatch timing, open
  loop, dependencies and a server that dies mid-run. It is tested here too.

The end-to-end test against a real vLLM server lives elsewhere.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jobs.load.loadgen import run_load, summarize
from jobs.schemas import ChatRequest, RequestRecord
from jobs.signals.enginemetrics import parse_metrics
from jobs.stub.stubserver import StubServer

PROMPT_TOKENS = 42  # what the double reports in usage.prompt_tokens


class FakeVllmChatServer:
    """Test double of vLLM's streamed chat and completions APIs; counts requests in flight.

    Script keys (JSON in the last message's content, or the ``prompt``): ``i``
    request index, ``ttft`` seconds before the first content chunk, ``itl``
    seconds between content chunks, ``status`` an HTTP error status to answer
    with, ``empty`` stream no content chunk at all, ``no_usage`` omit the usage
    chunk, ``error_at`` send vLLM's in-stream error object instead of content
    chunk number ``error_at``, ``cached`` report that many
    ``prompt_tokens_details.cached_tokens``. ``bodies`` and ``paths`` record
    what was posted.
    """

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.arrivals: list[int] = []
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._chat, methods=["POST"]),
            ]
        )
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake vLLM server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def _enter(self, index: int) -> None:
        with self._lock:
            self.arrivals.append(index)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        completions = request.url.path == "/v1/completions"
        script = json.loads(body["prompt"] if completions else body["messages"][-1]["content"])
        with self._lock:
            self.bodies.append(body)
            self.paths.append(request.url.path)
        self._enter(script["i"])
        if "status" in script:
            self._leave()
            return JSONResponse({"error": {"message": "boom"}}, status_code=script["status"])
        stream = self._stream(body, script, completions)
        return StreamingResponse(stream, media_type="text/event-stream")

    async def _stream(
        self, body: dict[str, Any], script: dict[str, Any], completions: bool
    ) -> AsyncIterator[str]:
        left = False
        try:

            def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
                choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
                if completions:
                    choice["text"] = delta.get("content", "")
                else:
                    choice["delta"] = delta
                return "data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n"

            n = 0 if script.get("empty") else int(body["max_tokens"])
            if not completions:
                yield chunk({"role": "assistant", "content": ""})
            await asyncio.sleep(script.get("ttft", 0.0))
            for k in range(n):
                if k:
                    await asyncio.sleep(script.get("itl", 0.0))
                if k == script.get("error_at"):
                    err = {"object": "error", "message": "engine died", "code": 500}
                    yield "data: " + json.dumps(err) + "\n\n"
                    break
                yield chunk({"content": f"t{k} "}, "length" if k == n - 1 else None)
            if not script.get("no_usage"):
                usage: dict[str, Any] = {
                    "prompt_tokens": PROMPT_TOKENS,
                    "completion_tokens": n,
                    "total_tokens": PROMPT_TOKENS + n,
                }
                if "cached" in script:
                    usage["prompt_tokens_details"] = {"cached_tokens": script["cached"]}
                yield "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n"
            # leave before [DONE]: the client dispatches its next request only after it
            self._leave()
            left = True
            yield "data: [DONE]\n\n"
        finally:
            if not left:
                self._leave()


@pytest.fixture()
def fake_vllm() -> Iterator[FakeVllmChatServer]:
    server = FakeVllmChatServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _req(i: int, max_tokens: int = 4, warmup: bool = False, **script: Any) -> ChatRequest:
    content = json.dumps({"i": i, **script})
    return ChatRequest(
        index=i,
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": content}],
        max_tokens=max_tokens,
        warmup=warmup,
    )


# --------------------------------------------------------------------------- run_load


@pytest.mark.timing
def test_timings_match_the_scripted_stream(fake_vllm: FakeVllmChatServer) -> None:
    ttft, itl, n = 0.15, 0.05, 5
    origin = time.perf_counter()
    records = asyncio.run(
        run_load(
            fake_vllm.base_url,
            "tiny",
            [_req(0, max_tokens=n, ttft=ttft, itl=itl)],
            concurrency=1,
            clock_origin=origin,
        )
    )
    (rec,) = records
    assert rec.success, rec.error
    assert rec.index == 0 and not rec.warmup
    assert rec.prompt_tokens == PROMPT_TOKENS and rec.output_tokens == n
    assert rec.ttft_s is not None and rec.e2el_s is not None and rec.tpot_s is not None
    # the role-only first chunk (empty content) does not count as the first token: the
    # lower bounds are the server's sleeps (they hold on any machine); the upper bounds
    # only catch gross errors, with room for a loaded CI machine's scheduling delays
    # (a 0.12 s margin failed there); which chunk is counted is pinned by the gap count
    assert ttft - 0.005 <= rec.ttft_s <= ttft + 1.0
    assert len(rec.itl_s) == n - 1
    assert all(itl - 0.03 <= gap <= itl + 1.0 for gap in rec.itl_s)
    assert rec.e2el_s == pytest.approx(rec.ttft_s + sum(rec.itl_s), abs=1e-9)
    assert ttft + (n - 1) * itl - 0.005 <= rec.e2el_s <= ttft + (n - 1) * itl + 2.0
    assert rec.tpot_s == pytest.approx((rec.e2el_s - rec.ttft_s) / (n - 1))
    assert 0.0 <= rec.start_s <= 1.0

    body = fake_vllm.bodies[0]
    assert body["model"] == "tiny"
    assert body["max_tokens"] == n
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    assert body["temperature"] == 0
    assert body["messages"][0] == {"role": "system", "content": "s"}


@pytest.mark.timing
def test_concurrency_limit_order_and_warmup_flag(fake_vllm: FakeVllmChatServer) -> None:
    # uneven durations so that completion order differs from list order
    durations = [0.12, 0.05, 0.09, 0.03, 0.1, 0.04, 0.08, 0.06, 0.02]
    requests = [_req(0, max_tokens=2, warmup=True, ttft=0.02)] + [
        _req(i, max_tokens=2, ttft=d) for i, d in enumerate(durations, start=1)
    ]
    seen: list[RequestRecord] = []
    records = asyncio.run(
        run_load(fake_vllm.base_url, "tiny", requests, concurrency=3, on_record=seen.append)
    )
    assert fake_vllm.max_in_flight == 3
    # requests sent together on separate connections may reach the server in any order;
    # the dispatch order is checked on the client side (start_s) below
    assert sorted(fake_vllm.arrivals) == list(range(len(requests)))
    assert [r.index for r in records] == list(range(len(requests)))  # returned in list order
    assert all(r.success for r in records)
    assert [r.warmup for r in records] == [True] + [False] * len(durations)
    assert sorted(r.index for r in seen) == list(range(len(requests)))
    starts = [r.start_s for r in records]
    assert starts == sorted(starts)


@pytest.mark.timing
def test_concurrency_one_is_sequential(fake_vllm: FakeVllmChatServer) -> None:
    requests = [_req(i, max_tokens=2, ttft=0.02) for i in range(4)]
    records = asyncio.run(run_load(fake_vllm.base_url, "tiny", requests, concurrency=1))
    assert fake_vllm.max_in_flight == 1
    assert fake_vllm.arrivals == [0, 1, 2, 3]
    for prev, cur in zip(records, records[1:], strict=False):
        assert prev.e2el_s is not None
        assert cur.start_s >= prev.start_s + prev.e2el_s


def test_failures_become_records(fake_vllm: FakeVllmChatServer) -> None:
    requests = [
        _req(0, ttft=0.01),
        _req(1, status=500),
        _req(2, empty=True),
        _req(3, ttft=3.0),  # exceeds timeout_s
        _req(4, ttft=0.01, no_usage=True, max_tokens=3),
        _req(5, ttft=0.01, error_at=2),
    ]
    records = asyncio.run(
        run_load(fake_vllm.base_url, "tiny", requests, concurrency=6, timeout_s=0.5)
    )
    by_index = {r.index: r for r in records}
    assert by_index[0].success
    assert not by_index[1].success and by_index[1].error is not None
    assert "HTTP 500" in by_index[1].error and "boom" in by_index[1].error
    assert not by_index[2].success and "content" in (by_index[2].error or "")
    assert not by_index[3].success and "timeout" in (by_index[3].error or "").lower()
    # without a usage chunk the content chunks are counted
    assert by_index[4].success and by_index[4].output_tokens == 3
    assert by_index[4].prompt_tokens is None
    assert not by_index[5].success and "engine died" in (by_index[5].error or "")
    for r in records:
        if not r.success:
            assert r.ttft_s is None and r.e2el_s is None and r.itl_s == []


def test_connection_refused_gives_failed_records() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    records = asyncio.run(
        run_load(f"http://127.0.0.1:{port}", "tiny", [_req(0), _req(1)], concurrency=2)
    )
    assert [r.index for r in records] == [0, 1]
    assert all(not r.success and r.error for r in records)


@pytest.mark.timing
def test_cancel_stops_dispatch_and_aborts_in_flight(fake_vllm: FakeVllmChatServer) -> None:
    """Cancelled once request 0 has finished and the two slots hold 5 s requests (the
    server saw a third arrival): the cancel follows the requests, not a timer, so a
    loaded machine cannot make request 0 late for it (seen in a CI run)."""
    cancel = threading.Event()
    cancelled_at: list[float] = []
    requests = [_req(0, ttft=0.05)] + [_req(i, ttft=5.0) for i in range(1, 10)]

    def cancel_when_both_slots_hold_slow_requests() -> None:
        deadline = time.monotonic() + 60
        while len(fake_vllm.arrivals) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # both slow requests are streaming
        cancelled_at.append(time.perf_counter())
        cancel.set()

    watcher = threading.Thread(target=cancel_when_both_slots_hold_slow_requests, daemon=True)
    watcher.start()
    records = asyncio.run(
        run_load(fake_vllm.base_url, "tiny", requests, concurrency=2, cancel=cancel)
    )
    ended = time.perf_counter()
    watcher.join(timeout=5)
    assert cancelled_at, "the two slow requests never arrived"
    # the in-flight 5 s requests were aborted, not waited for
    assert ended - cancelled_at[0] < 4.0
    assert [r.index for r in records] == [0]  # only what finished
    assert sorted(fake_vllm.arrivals) == [0, 1, 2]  # nothing dispatched after the cancel


def test_cancel_from_on_record_stops_dispatch(fake_vllm: FakeVllmChatServer) -> None:
    cancel = threading.Event()
    requests = [_req(i, ttft=0.02) for i in range(6)]
    records = asyncio.run(
        run_load(
            fake_vllm.base_url,
            "tiny",
            requests,
            concurrency=1,
            cancel=cancel,
            on_record=lambda r: cancel.set(),
        )
    )
    assert [r.index for r in records] == [0]
    assert fake_vllm.arrivals == [0]


def test_cancel_already_set_and_empty_list(fake_vllm: FakeVllmChatServer) -> None:
    cancel = threading.Event()
    cancel.set()
    assert (
        asyncio.run(run_load(fake_vllm.base_url, "m", [_req(0)], concurrency=1, cancel=cancel))
        == []
    )
    assert asyncio.run(run_load(fake_vllm.base_url, "m", [], concurrency=1)) == []
    assert fake_vllm.arrivals == []
    with pytest.raises(ValueError):
        asyncio.run(run_load(fake_vllm.base_url, "m", [_req(0)], concurrency=0))


def test_completions_api_and_body(fake_vllm: FakeVllmChatServer) -> None:
    request = ChatRequest(index=0, prompt=json.dumps({"i": 0, "ttft": 0.01}), max_tokens=3)
    (rec,) = asyncio.run(run_load(fake_vllm.base_url, "tiny", [request], concurrency=1))
    # content comes from choices[0].text: without it the stream would have no content chunk
    assert rec.success, rec.error
    assert rec.output_tokens == 3 and len(rec.itl_s) == 2
    assert fake_vllm.paths == ["/v1/completions"]
    body = fake_vllm.bodies[0]
    assert body["prompt"] == request.prompt and "messages" not in body
    assert body["model"] == "tiny" and body["max_tokens"] == 3
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0


def test_extra_body_is_merged_but_never_overrides_protected_fields(
    fake_vllm: FakeVllmChatServer,
) -> None:
    request = _req(0, max_tokens=2, ttft=0.01).model_copy(
        update={
            "extra_body": {
                "temperature": 0.7,
                "ignore_eos": False,
                "top_p": 0.9,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "model": "other",
                "stream": False,
                "stream_options": {"include_usage": False},
                "max_tokens": 99,
                "messages": [],
            }
        }
    )
    (rec,) = asyncio.run(run_load(fake_vllm.base_url, "tiny", [request], concurrency=1))
    assert rec.success, rec.error
    body = fake_vllm.bodies[0]
    assert body["temperature"] == 0.7 and body["ignore_eos"] is False and body["top_p"] == 0.9
    assert body["tools"] == [{"type": "function", "function": {"name": "f"}}]
    assert body["model"] == "tiny"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 2 and body["messages"] == request.messages


def test_body_that_is_not_json_fails_the_request(fake_vllm: FakeVllmChatServer) -> None:
    bad = _req(0, ttft=0.01).model_copy(update={"extra_body": {"temperature": math.nan}})
    records = asyncio.run(run_load(fake_vllm.base_url, "tiny", [bad, _req(1)], concurrency=1))
    assert [r.success for r in records] == [False, True]
    assert (records[0].error or "").startswith("ValueError: Out of range float")
    assert fake_vllm.arrivals == [1]


def test_cached_tokens_and_conversation_fields_are_recorded(
    fake_vllm: FakeVllmChatServer,
) -> None:
    requests = [
        _req(0, ttft=0.01, cached=32).model_copy(update={"conversation": 5, "turn": 0}),
        _req(1, ttft=0.01),  # reports no prompt_tokens_details
    ]
    records = asyncio.run(run_load(fake_vllm.base_url, "tiny", requests, concurrency=2))
    assert [(r.cached_tokens, r.conversation, r.turn) for r in records] == [
        (32, 5, 0),
        (None, None, None),
    ]
    assert summarize(records, 1.0)["total_cached_tokens"] == 32.0
    assert "total_cached_tokens" not in summarize(records[1:], 1.0)


def test_failed_dependency_still_releases_the_dependent(fake_vllm: FakeVllmChatServer) -> None:
    # "finished" means success or not: a dependency that got HTTP 500 ran
    requests = [_req(0, status=500), _req(1, ttft=0.01).model_copy(update={"after": 0})]
    records = asyncio.run(run_load(fake_vllm.base_url, "tiny", requests, concurrency=2))
    assert [r.success for r in records] == [False, True]


async def _serve_raw_sse(pieces: list[tuple[float, bytes]]) -> tuple[asyncio.Server, str]:
    """A bare HTTP/1.1 server on 127.0.0.1 that answers any request with ``pieces`` as one
    chunked ``text/event-stream`` body, each piece its own chunk written ``delay`` s after
    the previous one: SSE lines cut wherever the test wants across network reads."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.decode().split("\r\n"):
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for delay, piece in pieces:
            await asyncio.sleep(delay)
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_sse_lines_split_across_reads_crlf_and_a_huge_line() -> None:
    def event(delta: dict[str, Any], crlf: bool = False) -> bytes:
        data = json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode()
        return b"data: " + data + (b"\r\n\r\n" if crlf else b"\n\n")

    role = event({"role": "assistant", "content": ""})
    tok0, tok1 = event({"content": "a"}, crlf=True), event({"content": "b"})
    big = event({"content": "x" * 300_000})  # one line far above a 128 KiB line limit
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}\n\n'
    pieces = [
        (0.0, role),
        (0.1, tok0[:9]),  # 'data: {"c': the first token has not arrived yet
        (0.1, tok0[9:-3]),  # up to its '\r'
        (0.05, tok0[-3:] + tok1[:4]),  # its line ends here, with the next line's 'data'
        (0.05, tok1[4:]),
        (0.05, big[:100_000]),
        (0.0, big[100_000:]),
        (0.05, usage + b": a comment\n\n" + b"data: [DONE]\n\n"),
    ]

    async def go() -> RequestRecord:
        server, base_url = await _serve_raw_sse(pieces)
        async with server:
            (rec,) = await run_load(base_url, "m", [_stub_req(0)], concurrency=1)
        return rec

    rec = asyncio.run(go())
    assert rec.success, rec.error
    assert rec.output_tokens == 3 and rec.prompt_tokens == 7
    assert rec.ttft_s is not None and rec.ttft_s >= 0.25 - 0.01  # timed at the line's end
    assert len(rec.itl_s) == 2 and all(gap >= 0.05 - 0.01 for gap in rec.itl_s)


@pytest.fixture()
def stub() -> Iterator[StubServer]:
    """The project's stub server in a thread: TTFT 50 ms, 5 ms between tokens."""
    with StubServer(0.05, 0.005) as server:
        yield server


def _stub_req(i: int, max_tokens: int = 4, **fields: Any) -> ChatRequest:
    return ChatRequest(
        index=i, messages=[{"role": "user", "content": f"q {i}"}], max_tokens=max_tokens, **fields
    )


def _end(r: RequestRecord) -> float:
    assert r.e2el_s is not None
    return r.start_s + r.e2el_s


@pytest.mark.timing
def test_stub_streams_configured_tokens_with_configured_delays(stub: StubServer) -> None:
    n = 8
    with httpx.Client(base_url=stub.base_url, timeout=10) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models").json()["data"][0]["id"] == "stub"
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b c"}]}),
            ("/v1/completions", {"prompt": "a b c"}),
        ):
            body = {**body, "model": "m", "max_tokens": n, "stream": True}
            body["stream_options"] = {"include_usage": True}
            chunks: list[tuple[float, dict[str, Any]]] = []
            t0 = time.perf_counter()
            with client.stream("POST", path, json=body) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                lines: list[str] = []
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        if line != "data: [DONE]":
                            chunks.append((time.perf_counter(), json.loads(line[6:])))
            assert lines[-1] == "data: [DONE]"
            usage = chunks[-1][1]["usage"]
            assert chunks[-1][1]["choices"] == []
            assert usage["completion_tokens"] == n and usage["prompt_tokens"] == 4
            assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
            if path == "/v1/chat/completions":
                assert chunks[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                tokens = [(t, c) for t, c in chunks[1:-1]]
                assert all(c["choices"][0]["delta"]["content"] for _, c in tokens)
            else:
                tokens = chunks[:-1]
                assert all(c["choices"][0]["text"] for _, c in tokens)
            assert len(tokens) == n
            assert tokens[-1][1]["choices"][0]["finish_reason"] == "length"
            # The stub's promise: token k is due ttft + k * itl after the request body
            # arrived, absolute from the arrival (a token late after a stall is followed
            # by the others as soon as they are due: it catches up, never runs ahead).
            # The body arrives after t0, so on this clock no token may come before its
            # due time; 2 ms is the two monotonic clocks' rounding, not load.
            late = [t - (t0 + stub.ttft_s + k * stub.itl_s) for k, (t, _) in enumerate(tokens)]
            assert all(x >= -0.002 for x in late), late
            ttft = tokens[0][0] - t0
            span = tokens[-1][0] - tokens[0][0]
            # "roughly" late: loose for a noisy shared machine
            assert ttft < stub.ttft_s + 0.25
            assert span <= (n - 1) * stub.itl_s + 0.25
        # max_completion_tokens wins over max_tokens, as in vLLM
        body = {"model": "m", "messages": [], "max_tokens": 9, "max_completion_tokens": 2}
        got = client.post("/v1/chat/completions", json=body).json()
        assert got["usage"]["completion_tokens"] == 2
        assert got["choices"][0]["message"]["content"] == " tok tok"
        metrics = parse_metrics(client.get("/metrics").text)
    assert metrics["generation_tokens"] == 2 * n + 2 and metrics["request_success"] == 3
    assert metrics["num_requests_running"] == 0
    stats = stub.stats()
    assert stats["requests"] == 3 and stats["emits"] == 2 * n
    assert 0.0 <= stats["emit_lag_mean_s"] <= stats["emit_lag_max_s"]
    stub.reset_stats()  # a new window for the windowed stats; counters stay
    stats = stub.stats()
    assert stats["emits"] == 0 and stats["max_running"] == 0 and stats["requests"] == 3


@pytest.mark.timing
def test_open_loop_sends_on_schedule(stub: StubServer) -> None:
    gap, n = 0.02, 25  # 50 req/s; each request lasts ~65 ms, so several overlap
    requests = [_stub_req(i, arrival_s=i * gap) for i in range(n)]
    origin = time.perf_counter()
    records = asyncio.run(
        run_load(stub.base_url, "m", requests, concurrency=64, clock_origin=origin)
    )
    assert [r.index for r in records] == list(range(n)) and all(r.success for r in records)
    scheduled = [r.scheduled_s for r in records]
    assert all(s is not None for s in scheduled)
    # due times are absolute: exactly arrival_s apart, not accumulated sleeps
    assert [s - scheduled[0] for s in scheduled] == pytest.approx(  # type: ignore[operator]
        [i * gap for i in range(n)], abs=1e-9
    )
    assert 0.0 <= scheduled[0] < 0.5  # type: ignore[operator]
    lags = sorted(r.start_s - r.scheduled_s for r in records)  # type: ignore[operator]
    assert lags[0] >= 0.0  # never sent early
    assert lags[n // 2] < 0.02  # median lateness: loose for a noisy 2-core machine
    starts = [r.start_s for r in records]
    assert starts == sorted(starts)
    # open loop: requests go out while earlier ones are still streaming
    assert (
        sum(cur.start_s < _end(prev) for prev, cur in zip(records, records[1:], strict=False))
        >= n // 2
    )
    got = summarize(records, 1.0)
    assert 0.0 <= got["mean_dispatch_lag_ms"] <= got["max_dispatch_lag_ms"]


@pytest.mark.timing
def test_open_loop_respects_the_concurrency_cap(stub: StubServer) -> None:
    # all due at once: the cap, not the schedule, holds them back (as --max-concurrency)
    requests = [_stub_req(i, max_tokens=2, arrival_s=0.0) for i in range(9)]
    records = asyncio.run(run_load(stub.base_url, "m", requests, concurrency=3))
    assert all(r.success for r in records)
    assert stub.stats()["max_running"] == 3
    for r in records:
        in_flight = sum(o.start_s <= r.start_s < _end(o) for o in records if o is not r)
        assert in_flight <= 2
    lags = [r.start_s - r.scheduled_s for r in records]  # type: ignore[operator]
    # the fourth request waited for a slot: at least one request's duration (TTFT 50 ms)
    assert lags[3] >= 0.05 and lags[6] >= lags[3]


@pytest.mark.timing
def test_after_waits_for_the_previous_turn(stub: StubServer) -> None:
    # three conversations of three turns, turn-major; turn k waits for turn k-1
    requests = [
        _stub_req(
            3 * turn + conv,
            conversation=conv,
            turn=turn,
            after=None if turn == 0 else 3 * (turn - 1) + conv,
        )
        for turn in range(3)
        for conv in range(3)
    ]
    records = asyncio.run(run_load(stub.base_url, "m", requests, concurrency=9))
    by_index = {r.index: r for r in records}
    assert all(r.success for r in records)
    for r, req in zip(records, requests, strict=True):
        assert (r.conversation, r.turn) == (req.conversation, req.turn)
        if req.after is not None:
            assert r.start_s >= _end(by_index[req.after])
    # the three conversations still ran side by side
    assert stub.stats()["max_running"] == 3


def test_missing_dependency_fails_the_request_instead_of_hanging(stub: StubServer) -> None:
    requests = [
        _stub_req(0),
        _stub_req(1, after=77),  # not in the list
        _stub_req(2, after=1),  # its dependency never ran
        _stub_req(3, after=4),  # later in the list: would deadlock
        _stub_req(4, after=0),
    ]

    async def go() -> list[RequestRecord]:
        return await asyncio.wait_for(run_load(stub.base_url, "m", requests, concurrency=4), 10)

    records = asyncio.run(go())
    assert [r.index for r in records] == [0, 1, 2, 3, 4]
    assert [r.success for r in records] == [True, False, False, False, True]
    assert "77" in (records[1].error or "") and "not in the request list" in (
        records[1].error or ""
    )
    assert "never ran" in (records[2].error or "") and "77" in (records[2].error or "")
    assert "after this one" in (records[3].error or "")
    assert stub.stats()["requests"] == 2


@pytest.mark.timing
def test_duration_stops_dispatch_closed_loop(stub: StubServer) -> None:
    warm = _stub_req(0, max_tokens=2, warmup=True)
    requests = [warm] + [_stub_req(i, max_tokens=2) for i in range(1, 200)]
    t0 = time.perf_counter()
    records = asyncio.run(run_load(stub.base_url, "m", requests, concurrency=2, duration_s=0.4))
    elapsed = time.perf_counter() - t0
    measured = [r for r in records if not r.warmup]
    assert records[0].warmup and 2 <= len(measured) < 199
    assert [r.index for r in records] == list(range(len(records)))  # a prefix, no gaps
    assert all(r.success for r in records)  # requests in flight were let finish
    assert measured[-1].start_s - measured[0].start_s <= 0.4 + 0.005
    assert elapsed < 3.0


@pytest.mark.timing
def test_duration_stops_dispatch_open_loop(stub: StubServer) -> None:
    requests = [_stub_req(i, max_tokens=2, arrival_s=0.05 * i) for i in range(40)]
    records = asyncio.run(run_load(stub.base_url, "m", requests, concurrency=8, duration_s=0.3))
    assert 4 <= len(records) <= 7
    assert all(r.success for r in records)
    assert all(r.start_s - records[0].start_s <= 0.3 + 0.005 for r in records)
    with pytest.raises(ValueError):
        asyncio.run(run_load(stub.base_url, "m", requests, concurrency=1, duration_s=0.0))


@pytest.mark.timing
def test_server_killed_mid_run_gives_failed_records() -> None:
    # a subprocess stub killed with SIGKILL while 4 requests stream, 4 more to go
    requests = [_stub_req(i, max_tokens=60) for i in range(8)]
    with StubServer(0.02, 0.02, process=True) as server:
        timer = threading.Timer(0.4, server.kill)
        timer.start()
        t0 = time.perf_counter()
        try:
            records = asyncio.run(
                run_load(server.base_url, "m", requests, concurrency=4, timeout_s=30)
            )
        finally:
            timer.cancel()
        elapsed = time.perf_counter() - t0
    assert elapsed < 10.0
    assert [r.index for r in records] == list(range(8))
    assert not any(r.success for r in records)
    assert all(r.error for r in records)
    # cut mid-stream ("ServerDisconnected: response payload is not completed: ..."), then
    # refused connections ("ConnectionRefusedError: ... Connect call failed")
    assert any(
        "not completed" in (r.error or "") or "Disconnected" in (r.error or "") for r in records[:4]
    )
    assert any("Connect" in (r.error or "") for r in records[4:])


# --------------------------------------------------------------------------- summarize


def _ok(
    i: int, ttft: float, e2el: float, out: int, prompt: int, itl: list[float], warmup: bool = False
) -> RequestRecord:
    tpot = (e2el - ttft) / (out - 1) if out > 1 else None
    return RequestRecord(
        index=i,
        warmup=warmup,
        success=True,
        start_s=0.0,
        ttft_s=ttft,
        itl_s=itl,
        tpot_s=tpot,
        e2el_s=e2el,
        prompt_tokens=prompt,
        output_tokens=out,
    )


RECORDS = [
    _ok(0, 9.0, 9.5, 3, 1000, [0.2, 0.3], warmup=True),  # warm-up: ignored
    _ok(1, 0.1, 0.5, 5, 10, [0.1, 0.1, 0.1, 0.1]),  # TPOT 100 ms
    _ok(2, 0.3, 0.9, 4, 20, [0.2, 0.2, 0.2]),  # TPOT 200 ms
    RequestRecord(index=3, success=False, error="HTTP 500: boom", start_s=0.2),
]


def test_summarize_hand_computed() -> None:
    got = summarize(RECORDS, 2.0)
    expected = {
        "duration": 2.0,
        "completed": 2.0,
        "failed": 1.0,
        "total_input_tokens": 30.0,
        "total_output_tokens": 9.0,
        "request_throughput": 1.0,  # 2 / 2 s
        "output_throughput": 4.5,  # 9 / 2 s
        "total_token_throughput": 19.5,  # (30 + 9) / 2 s
        # TTFT 100, 300 ms; numpy linear percentiles: p90 = 100 + 0.9 * 200
        "mean_ttft_ms": 200.0,
        "median_ttft_ms": 200.0,
        "std_ttft_ms": 100.0,
        "p50_ttft_ms": 200.0,
        "p90_ttft_ms": 280.0,
        "p99_ttft_ms": 298.0,
        # TPOT 100, 200 ms
        "mean_tpot_ms": 150.0,
        "median_tpot_ms": 150.0,
        "std_tpot_ms": 50.0,
        "p50_tpot_ms": 150.0,
        "p90_tpot_ms": 190.0,
        "p99_tpot_ms": 199.0,
        # ITL pooled: 4 x 100 ms and 3 x 200 ms
        "mean_itl_ms": 1000.0 / 7,
        "median_itl_ms": 100.0,
        "std_itl_ms": 100.0 * math.sqrt(12) / 7,  # sqrt(p (1 - p)) * 100 with p = 4/7
        "p50_itl_ms": 100.0,
        "p90_itl_ms": 200.0,
        "p99_itl_ms": 200.0,
        # E2EL 500, 900 ms
        "mean_e2el_ms": 700.0,
        "median_e2el_ms": 700.0,
        "std_e2el_ms": 200.0,
        "p50_e2el_ms": 700.0,
        "p90_e2el_ms": 860.0,
        "p99_e2el_ms": 896.0,
    }
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


def test_summarize_goodput() -> None:
    got = summarize(RECORDS, 2.0, goodput_slos_ms={"ttft": 200, "e2el": 600})
    assert got["request_goodput"] == pytest.approx(0.5)  # only request 1 meets both
    got = summarize(RECORDS, 2.0, goodput_slos_ms={"tpot": 250})
    assert got["request_goodput"] == pytest.approx(1.0)  # SLO met when value <= SLO
    got = summarize(RECORDS, 2.0, goodput_slos_ms={"ttft": 50})
    assert got["request_goodput"] == 0.0
    assert "request_goodput" not in summarize(RECORDS, 2.0)
    with pytest.raises(ValueError):
        summarize(RECORDS, 2.0, goodput_slos_ms={"latency": 1})


def test_summarize_percentile_keys() -> None:
    got = summarize(RECORDS, 1.0, selected_percentiles=(99.9, 25))
    assert "p99.9_ttft_ms" in got and "p25_e2el_ms" in got and "p50_itl_ms" in got
    assert "p99_ttft_ms" not in got
    assert got["p99.9_ttft_ms"] == pytest.approx(299.8)
    with pytest.raises(ValueError):
        summarize(RECORDS, 1.0, selected_percentiles=(101,))


def test_summarize_no_success_gives_counts_only() -> None:
    records = [
        RequestRecord(index=0, success=False, error="x", start_s=0.0),
        _ok(1, 0.1, 0.2, 2, 5, [0.1], warmup=True),
    ]
    got = summarize(records, 3.0)
    assert got == {
        "duration": 3.0,
        "completed": 0.0,
        "failed": 1.0,
        "total_input_tokens": 0.0,
        "total_output_tokens": 0.0,
    }
    assert summarize([], 1.0)["completed"] == 0.0


def test_summarize_single_token_outputs_have_no_tpot_or_itl() -> None:
    records = [_ok(0, 0.1, 0.1, 1, 5, []), _ok(1, 0.3, 0.3, 1, 5, [])]
    got = summarize(records, 1.0, goodput_slos_ms={"tpot": 1})
    assert not any("tpot" in k or "itl" in k for k in got)
    assert got["mean_ttft_ms"] == pytest.approx(200.0)
    assert got["request_goodput"] == 2.0  # TPOT counts as 0 for 1-token outputs (as vLLM)
    assert all(math.isfinite(v) for v in got.values())


def test_summarize_rejects_bad_duration() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            summarize(RECORDS, bad)


def test_summarize_goodput_fraction() -> None:
    got = summarize(RECORDS, 2.0, goodput_slos_ms={"ttft": 200, "e2el": 600})
    assert got["goodput_fraction"] == pytest.approx(0.5)  # 1 good of 2 completed
    assert summarize(RECORDS, 2.0, goodput_slos_ms={"ttft": 50})["goodput_fraction"] == 0.0
    assert summarize(RECORDS, 2.0, goodput_slos_ms={"tpot": 250})["goodput_fraction"] == 1.0
    assert "goodput_fraction" not in summarize(RECORDS, 2.0)


def test_summarize_dispatch_lag() -> None:
    records = [
        _ok(0, 0.1, 0.2, 2, 5, [0.1]).model_copy(update={"start_s": 1.004, "scheduled_s": 1.0}),
        RequestRecord(index=1, success=False, error="x", start_s=2.01, scheduled_s=2.0),
        _ok(2, 0.1, 0.2, 2, 5, [0.1], warmup=True).model_copy(
            update={"start_s": 9.0, "scheduled_s": 1.0}  # warm-up: ignored
        ),
    ]
    got = summarize(records, 1.0)
    assert got["mean_dispatch_lag_ms"] == pytest.approx(7.0)
    assert got["max_dispatch_lag_ms"] == pytest.approx(10.0)
    assert "mean_dispatch_lag_ms" not in summarize(RECORDS, 1.0)


def test_the_heap_before_a_load_is_frozen_while_it_runs(stub: StubServer) -> None:
    # a full collection of a big heap stops the loop for tens of ms: what exists before the
    # load is kept out of the collector's scans while it runs, and given back after
    frozen: list[int] = []
    requests = [_stub_req(i, max_tokens=2) for i in range(3)]
    asyncio.run(
        run_load(
            stub.base_url,
            "m",
            requests,
            concurrency=1,
            on_record=lambda _: frozen.append(gc.get_freeze_count()),
        )
    )
    assert len(frozen) == 3 and min(frozen) > 1000
    assert gc.get_freeze_count() == 0
