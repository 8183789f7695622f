"""Tests of jobs.signals.enginelog: vLLM stats lines, probe-noise filter, start-up facts.

``data/enginelog/`` holds copies of ``/work/shared/cases/enginelog`` (with
``*.expected.json`` answers) and a trimmed real vLLM 0.32 CPU log (see its README).
The variations prove the parser is right for the kind of input (any prefix, any
suffix, unknown fields, field order), not for the exact bytes of the cases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jobs.signals.enginelog import (
    STARTUP_KEYS,
    STATS_KEYS,
    filter_noise,
    is_access_line,
    is_probe_noise,
    parse_stats_lines,
    startup_facts,
)

DATA = Path(__file__).parent / "data" / "enginelog"
CASES = sorted(p.name.removesuffix(".expected.json") for p in DATA.glob("*.expected.json"))

V1_LINE = (
    "INFO 05-12 08:01:39 [loggers.py:271] Engine 000: Avg prompt throughput: 5120.4 tokens/s, "
    "Avg generation throughput: 310.2 tokens/s, Running: 24 reqs, Waiting: 7 reqs, "
    "GPU KV cache usage: 62.8%, Prefix cache hit rate: 0.0%"
)
V1_EXPECTED = {
    "timestamp": "05-12 08:01:39",
    "engine": 0,
    "prompt_throughput_tok_s": 5120.4,
    "generation_throughput_tok_s": 310.2,
    "running": 24,
    "waiting": 7,
    "kv_cache_usage_pct": 62.8,
    "prefix_cache_hit_rate_pct": 0.0,
    "level": "INFO",
}


def _case(name: str) -> tuple[str, dict[str, Any]]:
    text = (DATA / f"{name}.log").read_text()
    return text, json.loads((DATA / f"{name}.expected.json").read_text())


def _assert_records(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """Every key the expected record names is equal; other keys are only the level and
    what the process tag says (process, source, pid, node_ip)."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert {k: g.get(k, "<absent>") for k in e} == e
        assert set(g) - set(e) <= {"level", "process", "source", "pid", "node_ip"}
        assert set(g) <= set(STATS_KEYS)


def test_cases_are_present() -> None:
    assert {"v0_two_line", "v1_probe_noise"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_stats_match_expected_case(case: str) -> None:
    text, expected = _case(case)
    _assert_records(parse_stats_lines(text), expected["stats_records"])


@pytest.mark.parametrize("case", CASES)
def test_noise_filter_matches_expected_case(case: str) -> None:
    text, expected = _case(case)
    kept, dropped = filter_noise(text)
    assert dropped == expected.get("noise_lines_dropped", 0)
    assert len(kept.splitlines()) == len(text.splitlines()) - dropped
    access = [line for line in kept.splitlines() if is_access_line(line)]
    if "kept_access_lines" in expected:
        assert access == expected["kept_access_lines"]
    # the filter never touches stats lines
    _assert_records(parse_stats_lines(kept), expected["stats_records"])


def test_v0_post_traffic_and_check_health_are_kept() -> None:
    v0, _ = _case("v0_two_line")
    assert any('"POST /v1/chat/completions' in line for line in filter_noise(v0)[0].splitlines())
    v1, _ = _case("v1_probe_noise")
    assert "Called check_health." in filter_noise(v1)[0]


@pytest.mark.parametrize(
    "prefix",
    [
        "",
        "2026-05-12T08:01:39.331095044Z ",
        "(EngineCore_DP0 pid=812) ",
        "2026-05-12T08:01:39Z stdout F (APIServer pid=1) ",
        "[pod/vllm-0/vllm] (RayWorkerWrapper pid=9, ip=10.0.0.2) ",
        "May 12 08:01:39 host vllm[1234]: ",
    ],
)
@pytest.mark.parametrize(
    "suffix", ["", " [k8s pod=x]", " [k8s pod=x, ns=y]", '\\n","stream":"stdout"}']
)
def test_any_prefix_and_suffix(prefix: str, suffix: str) -> None:
    (got,) = parse_stats_lines(prefix + V1_LINE + suffix)
    process = got.pop("process", None)
    tag = {k: got.pop(k) for k in ("source", "pid", "node_ip") if k in got}
    assert got == V1_EXPECTED
    if "pid=" in prefix:
        assert process is not None and prefix.find(process) > 0
        name, _, pid = process.partition(" pid=")
        assert tag["source"] == name and tag["pid"] == int(pid.split(",")[0])
        assert tag.get("node_ip") == ("10.0.0.2" if "ip=" in prefix else None)
    else:
        assert process is None and tag == {}


def test_docker_json_line() -> None:
    line = '{"log":"(APIServer pid=1) ' + V1_LINE + '\\n","stream":"stderr","time":"2026-05-12"}'
    (got,) = parse_stats_lines(line)
    assert got == {**V1_EXPECTED, "process": "APIServer pid=1", "source": "APIServer", "pid": 1}


def test_unknown_and_reordered_fields() -> None:
    line = (
        "DEBUG 09-01 10:00:00 [v1/metrics/loggers.py:300] 3 Engines Aggregated: "
        "Avg prompt throughput: 1.5 tokens/s, Avg generation throughput: 2.0 tokens/s, "
        "Running: 4 reqs, Waiting: 1 reqs, Deferred: 2 reqs, "
        "KV fetch: 1 waiting to start, 2 in progress, 3 completed waiting, Preemptions: 5, "
        "XPU KV cache usage: 7.5%, Prefix cache hit rate: 40.0%, Corrupted: 0 reqs, "
        "External prefix cache hit rate: 12.5%, MM cache hit rate: 3.0%, "
        "Spec acceptance: 0.75, Scheduler mode: fcfs [k8s pod=x]"
    )
    (got,) = parse_stats_lines(line)
    assert got == {
        "timestamp": "09-01 10:00:00",
        "engine": "aggregated:3",
        "prompt_throughput_tok_s": 1.5,
        "generation_throughput_tok_s": 2.0,
        "running": 4,
        "waiting": 1,
        "deferred": 2,
        "kv_fetch_waiting_to_start": 1,
        "kv_fetch_in_progress": 2,
        "kv_fetch_completed_waiting": 3,
        "preemptions": 5,
        "kv_cache_usage_pct": 7.5,
        "prefix_cache_hit_rate_pct": 40.0,
        "corrupted": 0,
        "external_prefix_cache_hit_rate_pct": 12.5,
        "mm_cache_hit_rate_pct": 3.0,
        "level": "DEBUG",
        "extra": {"Spec acceptance": 0.75, "Scheduler mode": "fcfs"},
    }


def test_v1_without_prefix_cache_and_engine_prefix() -> None:
    line = (
        "INFO 02-01 00:00:01 [loggers.py:80] Avg prompt throughput: 0.0 tokens/s, "
        "Avg generation throughput: 9.9 tokens/s, Running: 1 reqs, Waiting: 0 reqs, "
        "CPU KV cache usage: 0.3%"
    )
    (got,) = parse_stats_lines("Engine 001: ignored\n" + line.replace("] Avg", "] Engine 002: Avg"))
    assert got["engine"] == 2
    assert got["kv_cache_usage_pct"] == 0.3  # V1: the one device word is the KV cache
    assert "prefix_cache_hit_rate_pct" not in got and "cpu_kv_cache_usage_pct" not in got
    assert parse_stats_lines(line)[0]["engine"] == 0


def test_v0_pairs_per_process_with_prefixes() -> None:
    v0 = (
        "Avg prompt throughput: 1.0 tokens/s, Avg generation throughput: 2.0 tokens/s, "
        "Running: 3 reqs, Swapped: 1 reqs, Pending: 4 reqs, GPU KV cache usage: 5.0%, "
        "CPU KV cache usage: 6.0%."
    )
    text = "\n".join(
        [
            f"2026-01-01T00:00:00Z (pid=1) INFO 01-01 00:00:00 metrics.py:449] {v0}",
            f"2026-01-01T00:00:00Z (pid=2) INFO 01-01 00:00:00 metrics.py:449] {v0} [k8s pod=x]",
            # logged in the same call as its stats line: the same second
            "2026-01-01T00:00:00Z (pid=1) INFO 01-01 00:00:00 metrics.py:465] "
            "Prefix cache hit rate: GPU: 12.50%, CPU: 1.00% [k8s pod=x]",
        ]
    )
    first, second = parse_stats_lines(text)
    assert first["process"] == "pid=1" and second["process"] == "pid=2"
    assert (first["swapped"], first["waiting"], first["cpu_kv_cache_usage_pct"]) == (1, 4, 6.0)
    assert first["prefix_cache_hit_rate_pct"] == 12.5
    assert first["cpu_prefix_cache_hit_rate_pct"] == 1.0
    assert second["prefix_cache_hit_rate_pct"] is None
    assert "cpu_prefix_cache_hit_rate_pct" not in second


def test_non_stats_lines_are_ignored() -> None:
    text = "\n".join(
        [
            "INFO 01-01 00:00:00 [loggers.py:200] Engine 000: Iteration(5): 1 context requests, "
            "9 context tokens, 0 generation requests, 0 generation tokens, iteration elapsed "
            "time: 1.00 ms, GPU KV cache usage: 1.0%",
            "Avg prompt throughput: 1.0 tokens/s",  # no vLLM record header
            "INFO 01-01 00:00:00 [metrics.py:1] Prefix cache hit rate: GPU: 1.00%, CPU: 0.00%",
            "garbage: 1, : :, ,,,",
            "",
        ]
    )
    assert parse_stats_lines(text) == []


@pytest.mark.parametrize(
    ("line", "noise"),
    [
        ('INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK', True),
        ('(APIServer pid=1) INFO:     10.0.0.1:5 - "GET /metrics HTTP/1.1" 200 OK', True),
        ('2026-05-12T08:00:00Z INFO:  10.0.0.1:5 - "GET /metrics/ HTTP/1.1" 200 OK [k8s]', True),
        ('INFO:     10.0.0.1:5 - "POST /ping HTTP/1.1" 200 OK', True),
        ('INFO:     10.0.0.1:5 - "HEAD /health?probe=1 HTTP/2" 204 No Content', True),
        ('10.0.0.1 - - [12/May/2026:08:00:00 +0000] "GET /health HTTP/1.1" 200 2 "-" "kube"', True),
        ('INFO:     10.0.0.1:5 - "GET /health HTTP/1.1" 503 Service Unavailable', False),
        ('INFO:     10.0.0.1:5 - "GET /metrics HTTP/1.1" 500 Internal Server Error', False),
        ('INFO:     10.0.0.1:5 - "GET /metrics HTTP/1.1" 307 Temporary Redirect', False),
        ('INFO:     10.0.0.1:5 - "POST /v1/chat/completions HTTP/1.1" 200 OK', False),
        ('INFO:     10.0.0.1:5 - "GET /healthz-report HTTP/1.1" 200 OK', False),
        ("DEBUG 05-11 18:00:44 [async_llm.py:467] Called check_health.", False),
        ("INFO 05-11 18:00:44 [launcher.py:195] Route: /health, Methods: GET", False),
    ],
)
def test_is_probe_noise(line: str, noise: bool) -> None:
    assert is_probe_noise(line) is noise


def test_filter_noise_keeps_line_endings() -> None:
    text = 'a\r\nINFO: x - "GET /health HTTP/1.1" 200 OK\r\nb'
    assert filter_noise(text) == ("a\r\nb", 1)
    assert filter_noise("") == ("", 0)


def test_real_vllm032_cpu_log() -> None:
    text = (DATA / "vllm032_cpu_startup.log").read_text()
    assert startup_facts(text) == {
        "vllm_version": "0.32.0",
        "max_model_len": 2048,
        "available_kv_cache_memory_gib": 1.0,
        "kv_cache_device": "CPU",
        "kv_cache_size_tokens": 4_194_304,
        "max_concurrency_context_tokens": 2048,
        "max_concurrency": 2048.0,
        "init_engine_time_s": 16.13,
    }
    assert parse_stats_lines(text) == [
        {
            "timestamp": "11-29 11:34:24",
            "engine": 0,
            "prompt_throughput_tok_s": 493.2,
            "generation_throughput_tok_s": 10.5,
            "running": 0,
            "waiting": 0,
            "kv_cache_usage_pct": 0.0,
            "prefix_cache_hit_rate_pct": 23.9,
            "level": "INFO",
            "process": "APIServer pid=13784",
            "source": "APIServer",
            "pid": 13784,
        }
    ]
    kept, dropped = filter_noise(text)
    assert dropped == 15
    assert "GET /health" not in kept and "GET /metrics" not in kept
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in kept


def test_startup_facts_gpu_and_older_wordings() -> None:
    p = "2026-01-01T00:00:00Z (EngineCore_DP0 pid=7) "
    text = "\n".join(
        [
            f"{p}INFO 01-01 00:00:00 [api_server.py:1] vLLM API server version 0.9.2",
            f"{p}INFO 01-01 00:00:01 [gpu_model_runner.py:1] Model loading took 14.9889 GiB "
            "and 5.123 seconds",
            f"{p}INFO 01-01 00:00:02 [gpu_worker.py:1] Available KV cache memory: 54.75 GiB",
            f"{p}INFO 01-01 00:00:02 [kv_cache_utils.py:1] GPU KV cache size: 448,512 tokens",
            f"{p}INFO 01-01 00:00:02 [kv_cache_utils.py:2] Maximum concurrency for 32,768 "
            "tokens per request: 13.69x [k8s pod=x]",
            f"{p}INFO 01-01 00:00:03 [core.py:1] init engine (profile, create kv cache, warmup "
            "model) took 40.50 s (compilation: 20.25 s)",
            f"{p}INFO 01-01 00:00:04 [kv_cache_utils.py:1] GPU KV cache size: 1 tokens",
            "GPU KV cache size: 7 tokens (no record header: ignored)",
        ]
    )
    assert startup_facts(text) == {
        "vllm_version": "0.9.2",
        "model_weights_gib": 14.9889,
        "model_load_time_s": 5.123,
        "available_kv_cache_memory_gib": 54.75,
        "kv_cache_device": "GPU",
        "kv_cache_size_tokens": 448_512,
        "max_concurrency_context_tokens": 32_768,
        "max_concurrency": 13.69,
        "init_engine_time_s": 40.5,
        "compilation_time_s": 20.25,
    }
    assert set(startup_facts(text)) <= set(STARTUP_KEYS)


def test_startup_facts_v0() -> None:
    text = "\n".join(
        [
            "INFO 01-01 00:00:00 llm_engine.py:1] Initializing an LLM engine (v0.6.3.post1) "
            "with config: model='m'",
            "INFO 01-01 00:00:01 worker.py:1] Memory profiling results: total_gpu_memory=79.15GiB"
            " initial_memory_usage=15.2GiB kv_cache_size=54.75GiB gpu_memory_utilization=0.90",
            "INFO 01-01 00:00:01 gpu_executor.py:1] # GPU blocks: 2080, # CPU blocks: 2048",
            "INFO 01-01 00:00:01 gpu_executor.py:2] Maximum concurrency for 32768 tokens per "
            "request: 1.02x",
            "INFO 01-01 00:00:09 llm_engine.py:2] init engine (profile, create kv cache, warmup "
            "model) took 3.67 seconds",
        ]
    )
    assert startup_facts(text) == {
        "vllm_version": "0.6.3.post1",
        "available_kv_cache_memory_gib": 54.75,
        "num_gpu_blocks": 2080,
        "num_cpu_blocks": 2048,
        "max_concurrency_context_tokens": 32768,
        "max_concurrency": 1.02,
        "init_engine_time_s": 3.67,
    }
    assert startup_facts("no vllm here\n") == {}
