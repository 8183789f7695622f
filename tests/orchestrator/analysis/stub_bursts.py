"""Request records and summary metrics from the stub server, streamed in bursts or paced.

``burst``: the stub with an ITL of 0 writes every token of a request at once, as a vLLM
API server starved of CPU flushes its queued chunks (the tiny-model run of issue #22:
APC-on TPOT p50 0.0 ms); ``paced``: one token every 4 ms. Each is measured once per test
session by the real client (:func:`jobs.load.loadgen.run_load`, the stub in its own process so
that its writes are not interleaved with the client by the GIL) and summarised as the
runner does (:func:`jobs.load.loadgen.summarize`, :func:`jobs.run.segment.itl_burst_fraction`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from jobs.load.loadgen import run_load, summarize
from jobs.run.segment import itl_burst_fraction
from jobs.schemas import ChatRequest
from jobs.stub.stubserver import StubServer

#: Stub timing: TTFT and the ITL of each stream kind (s).
TTFT_S = 0.004
ITL_S = {"burst": 0.0, "paced": 0.004}
#: Requests per run and tokens per request.
REQUESTS, TOKENS = 12, 16


@functools.cache
def _measure(kind: str) -> tuple[tuple[dict[str, Any], ...], tuple[tuple[str, float], ...]]:
    requests = [
        ChatRequest(index=i, messages=[{"role": "user", "content": f"q {i}"}], max_tokens=TOKENS)
        for i in range(REQUESTS)
    ]
    with StubServer(TTFT_S, ITL_S[kind], process=True) as stub:
        start = time.perf_counter()
        records = asyncio.run(run_load(stub.base_url, "m", requests, concurrency=2))
        duration = time.perf_counter() - start
    assert all(r.success for r in records), [r.error for r in records if not r.success]
    metrics = summarize(records, duration)
    burst = itl_burst_fraction(records)
    if burst is not None:
        metrics["itl_burst_fraction"] = burst
    return tuple(r.model_dump(mode="json") for r in records), tuple(metrics.items())


def stub_run(kind: str) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """``(request dicts as jobs.schemas.RequestRecord dumps, summary metrics)`` of one run
    against the stub streaming ``kind`` (``"burst"`` or ``"paced"``); fresh copies."""
    records, metrics = _measure(kind)
    return [dict(r) for r in records], dict(metrics)
