"""Workload v2 on the real vLLM CPU build: one server, three runs (batch segments).

1. a ``template`` workload with two request classes and multi-turn
   conversations (closed loop, concurrency 2): turns wait for their previous
   turn, later turns reuse the cached history (``cached_tokens``), every
   metric is also reported per class;
2. the same template at a Poisson arrival rate with goodput SLOs: requests
   go out on schedule, goodput is reported;
3. a ``replay`` of chat and completions bodies at their own timestamps.

Also checked once for the whole server: the client's TTFT against the
server's TTFT histogram for the same requests, the parsed start-up facts and
the engine's stats lines.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.engine.processes import group_members
from jobs.run.runner import execute_batch
from jobs.schemas import BatchJob, EngineLaunch, RunSegment, WorkloadSpec
from tests.conftest import ENGINE_PYTHON, needs_engine

TEMPLATE = {
    "kind": "template",
    "num_requests": 12,
    "seed": 5,
    "output_tokens": 8,
    "warmup_requests": 1,
    "prefix_tokens": 128,
    "question_tokens": 16,
    "segments": [
        {"name": "rules", "role": "system", "fixed": True, "source": "instructions",
         "tokens": {"tokens": 200}},
        {"name": "docs", "source": "passages", "tokens": {"tokens": 0}},
        {"name": "q", "source": "question", "tokens": {"tokens": 24, "range_ratio": 0.5}},
    ],
    "classes": [
        {"name": "short", "weight": 2},
        {"name": "long", "weight": 1, "segment_tokens": {"docs": {"tokens": 300}}},
    ],
}  # fmt: skip

REPLAY = [
    {"messages": [{"role": "user", "content": "Name three prime numbers."}], "timestamp": 10.0},
    {"prompt": "The operations handbook says", "max_tokens": 6, "timestamp": 10.2},
    {"messages": [{"role": "user", "content": "And three more?"}], "timestamp": 10.6},
]


@pytest.mark.engine
@needs_engine
def test_template_multiturn_open_loop_and_replay_on_one_server(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    assert ENGINE_PYTHON is not None
    multi_turn = WorkloadSpec.model_validate(
        {**TEMPLATE, "concurrency": 2, "multi_turn": {"turns": 3, "answer_tokens": 24}}
    )
    poisson = WorkloadSpec.model_validate(
        {**TEMPLATE, "arrival": "poisson", "request_rate": 4.0, "concurrency": 8}
    )
    replay = WorkloadSpec.model_validate(
        {"kind": "replay", "replay": REPLAY, "arrival": "trace", "output_tokens": 8,
         "warmup_requests": 0}
    )  # fmt: skip
    slos = {"ttft": 60_000.0, "e2el": 120_000.0}  # generous: every request is good
    job = BatchJob(
        launch=EngineLaunch(
            engine_python=ENGINE_PYTHON,
            model_dir=str(tiny_model_dir),
            served_model_name="tiny",
            engine_args={
                "load_format": "dummy",
                "max_model_len": 2048,
                "enable_prefix_caching": True,
                "enable_prompt_tokens_details": True,
            },
            startup_timeout_s=600,
            log_path=str(tmp_path / "server.log"),
        ),
        segments=[
            RunSegment(run_id="multi", workload=multi_turn),
            RunSegment(run_id="poisson", workload=poisson, goodput_slos_ms=slos),
            RunSegment(run_id="replay", workload=replay),
        ],
        scrape_interval_s=0.5,
        request_timeout_s=120,
    )
    first, second, third = execute_batch(job)
    for r in (first, second, third):
        assert r.status == "succeeded", r.error
        assert not r.partial

    # 1. multi-turn: order, cached history, classes
    measured = {r.index: r for r in first.requests if not r.warmup}
    assert len(measured) == 12 and all(r.success for r in measured.values())
    later_turns = [r for r in measured.values() if (r.turn or 0) > 0]
    assert later_turns
    for r in measured.values():
        assert r.e2el_s is not None
    by_turn = {(r.conversation, r.turn): r for r in measured.values()}
    for (conv, turn), r in by_turn.items():
        if turn:
            prev = by_turn[(conv, turn - 1)]
            assert prev.e2el_s is not None
            assert r.start_s >= prev.start_s + prev.e2el_s - 1e-3  # sent after its previous turn
    # the grown history of later turns hits the prefix cache (whole 128-token CPU blocks)
    assert any((r.cached_tokens or 0) >= 128 for r in later_turns)
    assert {r.request_class for r in measured.values()} == {"short", "long"}
    assert first.metrics["short.completed"] + first.metrics["long.completed"] == 12
    assert first.metrics["total_cached_tokens"] >= 128

    # 2. open loop: on schedule, goodput
    records = [r for r in second.requests if not r.warmup]
    assert all(r.scheduled_s is not None for r in records)
    assert second.metrics["request_goodput"] > 0
    assert second.metrics["goodput_fraction"] == 1.0
    assert second.metrics["max_dispatch_lag_ms"] < 500  # the client kept up with 4 req/s

    # 3. replay: both APIs, the trace's spacing
    replayed = sorted((r for r in third.requests if not r.warmup), key=lambda r: r.index)
    assert [r.success for r in replayed] == [True] * 3
    assert replayed[1].output_tokens == 6  # the completions body's own max_tokens
    starts = [r.start_s for r in replayed]
    assert starts[2] - starts[0] >= 0.55  # timestamps 10.0 and 10.6

    # server view vs client view of the same requests (histogram deltas)
    for r in (first, second):
        server, client = r.metrics["server_mean_ttft_ms"], r.metrics["mean_ttft_ms"]
        assert r.metrics["server_count_ttft"] == r.metrics["completed"]
        # the server's TTFT starts when the API process got the request; the client's
        # adds HTTP and SSE delivery, so it is at least the server's (within noise)
        assert 0 < server <= client * 1.1 + 5, (server, client)
        gap = r.metrics["mean_ttft_client_minus_server_ms"]
        assert gap == pytest.approx(client - server)

    # engine log facts
    facts = first.engine_info["startup_facts"]
    assert facts["kv_cache_size_tokens"] > 0 and facts["vllm_version"].startswith("0.")
    assert isinstance(first.engine_info["stats_lines"], list)
    for r in (first, second, third):
        pgid = r.engine_info.get("pgid")
        if pgid is not None:
            assert group_members(pgid) == []
