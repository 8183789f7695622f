"""Tests of jobs.loadgen: summary maths by hand, and run_load against a fake vLLM server.

``FakeVllmChatServer`` below is a TEST DOUBLE of vLLM's OpenAI-compatible chat
endpoint (``POST /v1/chat/completions`` with ``stream: true``): a real HTTP server
(starlette under uvicorn on 127.0.0.1, a free port) that streams SSE chunks shaped
like vLLM's (a role-only first chunk with empty content, one chunk per token, a
trailing ``usage`` chunk with empty ``choices``, then ``data: [DONE]``) with known
sleeps. Each request's user message is a JSON script telling the double how to
behave. The end-to-end test against a real vLLM server lives elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jobs.loadgen import run_load, summarize
from jobs.schemas import ChatRequest, RequestRecord

PROMPT_TOKENS = 42  # what the double reports in usage.prompt_tokens


class FakeVllmChatServer:
    """Test double of vLLM's streamed chat-completions API; counts requests in flight.

    Script keys (JSON in the last message's content): ``i`` request index,
    ``ttft`` seconds before the first content chunk, ``itl`` seconds between
    content chunks, ``status`` an HTTP error status to answer with, ``empty``
    stream no content chunk at all, ``no_usage`` omit the usage chunk, ``error_at``
    send vLLM's in-stream error object instead of content chunk number ``error_at``.
    """

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.arrivals: list[int] = []
        self.bodies: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])])
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
        script = json.loads(body["messages"][-1]["content"])
        with self._lock:
            self.bodies.append(body)
        self._enter(script["i"])
        if "status" in script:
            self._leave()
            return JSONResponse({"error": {"message": "boom"}}, status_code=script["status"])
        return StreamingResponse(self._stream(body, script), media_type="text/event-stream")

    async def _stream(self, body: dict[str, Any], script: dict[str, Any]) -> AsyncIterator[str]:
        left = False
        try:

            def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                return "data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n"

            n = 0 if script.get("empty") else int(body["max_tokens"])
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
                usage = {
                    "prompt_tokens": PROMPT_TOKENS,
                    "completion_tokens": n,
                    "total_tokens": PROMPT_TOKENS + n,
                }
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
    # the role-only first chunk (empty content) does not count as the first token
    assert ttft - 0.005 <= rec.ttft_s <= ttft + 0.12
    assert len(rec.itl_s) == n - 1
    assert all(itl - 0.03 <= gap <= itl + 0.12 for gap in rec.itl_s)
    assert rec.e2el_s == pytest.approx(rec.ttft_s + sum(rec.itl_s), abs=1e-9)
    assert ttft + (n - 1) * itl - 0.005 <= rec.e2el_s <= ttft + (n - 1) * itl + 0.25
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


def test_cancel_stops_dispatch_and_aborts_in_flight(fake_vllm: FakeVllmChatServer) -> None:
    cancel = threading.Event()
    requests = [_req(0, ttft=0.05)] + [_req(i, ttft=5.0) for i in range(1, 10)]
    timer = threading.Timer(0.4, cancel.set)
    timer.start()
    t0 = time.perf_counter()
    try:
        records = asyncio.run(
            run_load(fake_vllm.base_url, "tiny", requests, concurrency=2, cancel=cancel)
        )
    finally:
        timer.cancel()
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0  # in-flight 5 s requests were aborted
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
