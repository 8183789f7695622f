"""Tests of jobs.metrics: parsing vLLM /metrics text of several vintages, scraping, run deltas.

The exposition texts in ``data/metrics/`` are copies of ``/work/shared/cases/metrics``
(published vLLM shapes, with ``*.expected.json`` answers) plus
``vllm032_cpu.txt`` captured from a real vLLM 0.32 CPU server (see ``README.md`` there).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from jobs.metrics import SAMPLE_KEYS, parse_metrics, scrape, summarize_samples
from jobs.schemas import MetricSample

DATA = Path(__file__).parent / "data" / "metrics"
CASES = sorted(p.name.removesuffix(".expected.json") for p in DATA.glob("*.expected.json"))


def test_cases_are_present() -> None:
    assert {"early_v1_block_units", "v010_old_and_new_names"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_parse_matches_expected_case(case: str) -> None:
    got = parse_metrics((DATA / f"{case}.txt").read_text())
    expected = json.loads((DATA / f"{case}.expected.json").read_text())
    assert set(got) <= set(SAMPLE_KEYS)

    for key in ("num_requests_running", "num_requests_waiting"):
        if key in expected:
            assert got[key] == expected[key]
    assert got["kv_cache_usage"] == pytest.approx(expected["kv_cache_usage_fraction"])

    for key in ("prefix_cache_queries", "prefix_cache_hits"):
        value, unit = expected[key]["value"], expected[key]["unit"]
        if unit == "tokens":
            assert got[key] == value
            assert f"{key}_blocks" not in got
        else:
            assert unit == "blocks"
            assert got[f"{key}_blocks"] == value
            assert key not in got, "block counts must never land in the token key"


def test_v010_prefers_new_names_and_does_not_double_count() -> None:
    got = parse_metrics((DATA / "v010_old_and_new_names.txt").read_text())
    # both old and new names carry 32 tokens: the result is 32, not 64
    assert got["prefix_cache_queries"] == 32.0
    assert got["prefix_cache_hits"] == 0.0
    # *_created timestamps (~1.75e9) are never taken as values
    assert all(v < 1e6 for v in got.values())


def test_new_name_wins_over_old_when_values_differ() -> None:
    text = """\
# HELP vllm:gpu_prefix_cache_queries_total queries, in terms of number of queried tokens.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{engine="0"} 5.0
# HELP vllm:prefix_cache_queries_total queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0"} 7.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0"} 0.9
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.25
"""
    got = parse_metrics(text)
    assert got["prefix_cache_queries"] == 7.0
    assert got["kv_cache_usage"] == 0.25


def test_old_token_counted_names_used_when_new_absent() -> None:
    text = """\
# HELP vllm:gpu_prefix_cache_hits_total hits, in terms of number of cached tokens.
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{engine="0"} 11.0
"""
    assert parse_metrics(text) == {"prefix_cache_hits": 11.0}


def test_old_names_without_help_are_taken_as_blocks() -> None:
    text = "vllm:gpu_prefix_cache_queries_total 3.0\n"
    assert parse_metrics(text) == {"prefix_cache_queries_blocks": 3.0}


def test_sum_over_engines_and_labels_but_max_for_usage() -> None:
    text = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 20.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 4.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 0.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 50.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1"} 1.0
vllm:time_to_first_token_seconds_bucket{le="+Inf"} 2.0
vllm:time_to_first_token_seconds_count 2.0
vllm:time_to_first_token_seconds_sum 0.3
"""
    assert parse_metrics(text) == {
        "num_requests_running": 5.0,
        "num_requests_waiting": 1.0,
        "kv_cache_usage": 0.75,
        "prefix_cache_hits": 30.0,
        "request_success": 5.0,
        "num_preemptions": 2.0,
        "prompt_tokens": 100.0,
        "generation_tokens": 50.0,
    }


def test_v0_hit_rate_gauge_kept_apart() -> None:
    text = """\
# TYPE vllm:gpu_prefix_cache_hit_rate gauge
vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.4
"""
    got = parse_metrics(text)
    assert got == {"gpu_prefix_cache_hit_rate_v0_fraction": 0.4}


def test_missing_and_unknown_metrics_are_absent_and_nan_skipped() -> None:
    text = """\
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} NaN
"""
    assert parse_metrics(text) == {}
    assert parse_metrics("") == {}


def test_malformed_text_raises_value_error() -> None:
    with pytest.raises(ValueError):
        parse_metrics("vllm:num_requests_running{engine=0 not-a-number\n")


def test_real_vllm_032_cpu_capture() -> None:
    path = DATA / "vllm032_cpu.txt"
    if not path.exists():
        pytest.skip("no capture of a real vLLM 0.32 /metrics in tests/jobs/data/metrics")
    got = parse_metrics(path.read_text())
    for key in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "num_preemptions",
    ):
        assert key in got, key
    assert "prefix_cache_queries_blocks" not in got
    assert 0.0 <= got["kv_cache_usage"] <= 1.0
    assert got["request_success"] >= 1
    assert 0 <= got["prefix_cache_hits"] <= got["prefix_cache_queries"]
    assert got["generation_tokens"] >= got["request_success"]
    # the capture's own numbers: 5 requests x 8 tokens, ~475-token prompts sharing a prefix
    assert got["request_success"] == 5.0
    assert got["generation_tokens"] == 40.0
    assert got["prompt_tokens"] == 2373.0
    assert got["prefix_cache_queries"] == 2373.0
    assert got["prefix_cache_hits"] == 1536.0


def _sample(t: float, phase: str, **values: float) -> MetricSample:
    return MetricSample(t_s=t, phase=phase, values=values)  # type: ignore[arg-type]


def test_summarize_samples_deltas_peaks_and_mean() -> None:
    samples = [
        _sample(
            0.0,
            "before",
            prefix_cache_queries=1000,
            prefix_cache_hits=200,
            kv_cache_usage=0.0,
            num_requests_running=0,
            num_requests_waiting=0,
            num_preemptions=1,
            prompt_tokens=5000,
            generation_tokens=100,
            request_success=3,
        ),
        _sample(1.0, "during", kv_cache_usage=0.2, num_requests_running=4, num_requests_waiting=2),
        _sample(2.0, "during", kv_cache_usage=0.6, num_requests_running=3, num_requests_waiting=5),
        _sample(
            3.0,
            "after",
            prefix_cache_queries=3000,
            prefix_cache_hits=1700,
            kv_cache_usage=0.0,
            num_requests_running=0,
            num_requests_waiting=0,
            num_preemptions=4,
            prompt_tokens=7000,
            generation_tokens=420,
            request_success=13,
        ),
    ]
    got = summarize_samples(samples)
    assert got == {
        "prefix_cache_queries_delta": 2000.0,
        "prefix_cache_hits_delta": 1500.0,
        "prefix_cache_hit_rate": pytest.approx(0.75),
        "num_preemptions_delta": 3.0,
        "prompt_tokens_delta": 2000.0,
        "generation_tokens_delta": 320.0,
        "request_success_delta": 10.0,
        "kv_cache_usage_peak": 0.6,
        "kv_cache_usage_mean": pytest.approx(0.4),
        "num_requests_running_peak": 4.0,
        "num_requests_waiting_peak": 5.0,
    }


def test_summarize_samples_zero_queries_omits_hit_rate() -> None:
    samples = [
        _sample(0.0, "before", prefix_cache_queries=10, prefix_cache_hits=4),
        _sample(1.0, "after", prefix_cache_queries=10, prefix_cache_hits=4),
    ]
    got = summarize_samples(samples)
    assert got == {"prefix_cache_queries_delta": 0.0, "prefix_cache_hits_delta": 0.0}


def test_summarize_samples_missing_counters_and_empty() -> None:
    samples = [_sample(0.0, "before", kv_cache_usage=0.1), _sample(1.0, "after")]
    got = summarize_samples(samples)
    assert got == {
        "prefix_cache_queries_delta": 0.0,
        "prefix_cache_hits_delta": 0.0,
        "kv_cache_usage_peak": 0.1,
    }
    assert summarize_samples([]) == {
        "prefix_cache_queries_delta": 0.0,
        "prefix_cache_hits_delta": 0.0,
    }


def test_summarize_samples_counter_reset_gives_no_delta() -> None:
    samples = [
        _sample(0.0, "before", prefix_cache_queries=500, prefix_cache_hits=100, num_preemptions=9),
        _sample(1.0, "after", prefix_cache_queries=40, prefix_cache_hits=10, num_preemptions=0),
    ]
    got = summarize_samples(samples)
    assert "prefix_cache_hit_rate" not in got
    assert "num_preemptions_delta" not in got
    assert got["prefix_cache_queries_delta"] == 0.0


def test_summarize_samples_block_units_stay_apart() -> None:
    samples = [
        _sample(0.0, "before", prefix_cache_queries_blocks=100, prefix_cache_hits_blocks=10),
        _sample(1.0, "after", prefix_cache_queries_blocks=300, prefix_cache_hits_blocks=110),
    ]
    got = summarize_samples(samples)
    assert got["prefix_cache_queries_blocks_delta"] == 200.0
    assert got["prefix_cache_hits_blocks_delta"] == 100.0
    assert got["prefix_cache_hit_rate_blocks"] == pytest.approx(0.5)
    assert "prefix_cache_hit_rate" not in got
    assert got["prefix_cache_queries_delta"] == 0.0


def test_scrape_uses_metrics_path_and_raises_on_http_error() -> None:
    body = (DATA / "v010_old_and_new_names.txt").read_text()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics" and request.url.host == "ok":
            return httpx.Response(200, text=body)
        return httpx.Response(503, text="unavailable")

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            got = await scrape(client, "http://ok/")
            assert got["prefix_cache_queries"] == 32.0
            with pytest.raises(httpx.HTTPStatusError):
                await scrape(client, "http://down")

    asyncio.run(main())
