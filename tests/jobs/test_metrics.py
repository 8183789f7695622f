"""Tests of jobs.signals.enginemetrics: parsing vLLM /metrics text of several vintages, scraping,
run deltas.

The exposition texts in ``data/metrics/`` are copies of ``/work/shared/cases/metrics``
(published vLLM shapes, with ``*.expected.json`` answers) plus
``vllm032_cpu.txt`` captured from a real vLLM 0.32 CPU server (see ``README.md`` there).
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Histogram as PromHistogram

from jobs.schemas import MetricSample
from jobs.signals.enginemetrics import SAMPLE_KEYS, parse_metrics, scrape, summarize_samples
from jobs.signals.histograms import (
    HISTOGRAMS,
    Histogram,
    histogram_delta,
    histogram_quantile,
    parse_histograms,
    summarize_histograms,
)

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
        # the histogram's _sum/_count (added with the latency histograms), nothing else of it
        "ttft_seconds_sum": 0.3,
        "ttft_seconds_count": 2.0,
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
    """Counters the server does not export are unknown: absent, never 0 (a 0 reads as
    "no prefix cache queries", a plausible wrong number)."""
    samples = [_sample(0.0, "before", kv_cache_usage=0.1), _sample(1.0, "after")]
    got = summarize_samples(samples)
    assert got == {"kv_cache_usage_peak": 0.1}
    assert summarize_samples([]) == {}


def test_summarize_samples_counter_reset_gives_no_delta() -> None:
    samples = [
        _sample(0.0, "before", prefix_cache_queries=500, prefix_cache_hits=100, num_preemptions=9),
        _sample(1.0, "after", prefix_cache_queries=40, prefix_cache_hits=10, num_preemptions=0),
    ]
    notes: list[str] = []
    got = summarize_samples(samples, notes)
    assert "prefix_cache_hit_rate" not in got
    assert "num_preemptions_delta" not in got
    # a restart between the scrapes: the deltas are unknown (trial of 2026-12-04: they
    # read 0), and the notes say why
    assert "prefix_cache_queries_delta" not in got and "prefix_cache_hits_delta" not in got
    assert notes == [
        "prefix_cache_queries went down from 500 to 40 between the first and last scrapes "
        "(a server restart?): no delta, no hit rate",
        "prefix_cache_hits went down from 100 to 10 between the first and last scrapes "
        "(a server restart?): no delta, no hit rate",
    ]


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
    assert "prefix_cache_queries_delta" not in got  # no token-counted counter


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


# -- latency histograms -------------------------------------------------------------------

INF = math.inf

# Two engines as vLLM (prometheus_client) writes them: per label set the cumulative buckets,
# _count, _sum; the _created timestamps as a family of their own. (vLLM's real TTFT bucket
# list is longer; a shorter one is just as valid.)
TWO_ENGINES = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
vllm:num_requests_running{engine="1",model_name="tiny"} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="tiny"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="tiny"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.06",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.13
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.02",model_name="tiny"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.04",model_name="tiny"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.06",model_name="tiny"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="tiny"} 6.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="tiny"} 6.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="tiny"} 0.5
# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{engine="0",model_name="tiny"} 1.79594720788195e+09
vllm:time_to_first_token_seconds_created{engine="1",model_name="tiny"} 1.79594720788195e+09
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 4.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 4.0
vllm:request_queue_time_seconds_count{engine="0",model_name="tiny"} 4.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="tiny"} 0.001
vllm:request_queue_time_seconds_bucket{engine="1",le="0.3",model_name="tiny"} 5.0
vllm:request_queue_time_seconds_bucket{engine="1",le="+Inf",model_name="tiny"} 6.0
vllm:request_queue_time_seconds_count{engine="1",model_name="tiny"} 6.0
vllm:request_queue_time_seconds_sum{engine="1",model_name="tiny"} 0.9
# HELP vllm:request_queue_time_seconds_created Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds_created gauge
vllm:request_queue_time_seconds_created{engine="0",model_name="tiny"} 1.79594720788195e+09
vllm:request_queue_time_seconds_created{engine="1",model_name="tiny"} 1.79594720788195e+09
"""


def _vllm_histogram(
    name: str, bounds: list[str], engines: list[tuple[list[float], float]], help_: str = "h"
) -> str:
    """One histogram family as vLLM writes it; ``engines``: (cumulative counts, sum) each.

    ``bounds`` are the ``le`` strings without "+Inf" (appended); each counts list includes
    the +Inf bucket, whose value is also the ``_count``.
    """
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    for engine, (counts, total) in enumerate(engines):
        labels = f'engine="{engine}",model_name="tiny"'
        for le, c in zip([*bounds, "+Inf"], counts, strict=True):
            lines.append(f'{name}_bucket{{engine="{engine}",le="{le}",model_name="tiny"}} {c}')
        lines.append(f"{name}_count{{{labels}}} {counts[-1]}")
        lines.append(f"{name}_sum{{{labels}}} {total}")
    lines += [f"# HELP {name}_created {help_}", f"# TYPE {name}_created gauge"]
    lines += [
        f'{name}_created{{engine="{e}",model_name="tiny"}} 1.79594720788195e+09'
        for e in range(len(engines))
    ]
    return "\n".join(lines) + "\n"


def test_histogram_table_names() -> None:
    assert set(HISTOGRAMS) == {"ttft", "e2el", "queue", "prefill", "decode", "itl", "inference"}
    assert HISTOGRAMS["itl"][0] == (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    )
    assert HISTOGRAMS["ttft"][0] == ("vllm:time_to_first_token_seconds",)
    assert HISTOGRAMS["e2el"][0] == ("vllm:e2e_request_latency_seconds",)
    for key in HISTOGRAMS:
        assert f"{key}_seconds_sum" in SAMPLE_KEYS
        assert f"{key}_seconds_count" in SAMPLE_KEYS


def test_parse_histograms_sums_engines_by_le_and_skips_created() -> None:
    got = parse_histograms(TWO_ENGINES)
    assert set(got) == {"ttft", "queue"}
    ttft = got["ttft"]
    assert ttft.bounds == (0.02, 0.04, 0.06, INF)
    assert ttft.counts == (1.0, 5.0, 9.0, 10.0)
    assert ttft.count == 10.0
    assert ttft.sum == pytest.approx(0.63)
    queue = got["queue"]
    assert (queue.bounds, queue.counts, queue.count) == ((0.3, INF), (9.0, 10.0), 10.0)
    assert queue.sum == pytest.approx(0.901)


def test_parse_metrics_adds_histogram_sum_and_count_only() -> None:
    got = parse_metrics(TWO_ENGINES)
    assert got == {
        "num_requests_running": 1.0,
        "ttft_seconds_sum": pytest.approx(0.63),
        "ttft_seconds_count": 10.0,
        "queue_seconds_sum": pytest.approx(0.901),
        "queue_seconds_count": 10.0,
    }
    assert set(got) <= set(SAMPLE_KEYS)


@pytest.mark.parametrize("case", CASES)
def test_shared_cases_have_no_histogram_keys(case: str) -> None:
    text = (DATA / f"{case}.txt").read_text()
    got = parse_metrics(text)
    assert parse_histograms(text) == {}
    expected_old = {
        "early_v1_block_units": {
            "kv_cache_usage",
            "num_requests_running",
            "num_requests_waiting",
            "prefix_cache_hits_blocks",
            "prefix_cache_queries_blocks",
        },
        "v010_old_and_new_names": {"kv_cache_usage", "prefix_cache_hits", "prefix_cache_queries"},
    }
    if case in expected_old:
        assert set(got) == expected_old[case]
    assert not any(k.endswith(("_seconds_sum", "_seconds_count")) for k in got)


def _real_capture() -> str:
    path = DATA / "vllm032_cpu.txt"
    if not path.exists():
        pytest.skip("no capture of a real vLLM 0.32 /metrics in tests/jobs/data/metrics")
    return path.read_text()


def test_real_vllm_032_capture_histograms() -> None:
    text = _real_capture()
    hists = parse_histograms(text)
    assert set(hists) == set(HISTOGRAMS)
    # 5 requests x 8 tokens: 5 observations each, 5 x 7 inter-token gaps
    assert {k: h.count for k, h in hists.items()} == {
        "ttft": 5.0,
        "e2el": 5.0,
        "queue": 5.0,
        "prefill": 5.0,
        "decode": 5.0,
        "itl": 35.0,
        "inference": 5.0,
    }
    ttft = hists["ttft"]
    assert len(ttft.bounds) == 23 and ttft.bounds[-1] == INF
    assert ttft.counts[:5] == (0.0, 0.0, 2.0, 3.0, 5.0)  # le 0.001 0.005 0.01 0.02 0.04
    assert ttft.sum == pytest.approx(0.09016299247741699)
    # what the names mean: RUNNING = PREFILL + DECODE; the decode time is the ITL gaps
    assert hists["inference"].sum == pytest.approx(hists["prefill"].sum + hists["decode"].sum)
    assert hists["itl"].sum == pytest.approx(hists["decode"].sum)

    got = parse_metrics(text)
    new = {k for k in got if k.endswith(("_seconds_sum", "_seconds_count"))}
    assert new == {f"{k}_seconds_{p}" for k in HISTOGRAMS for p in ("sum", "count")}
    assert got["itl_seconds_count"] == 35.0
    assert got["e2el_seconds_sum"] == pytest.approx(0.180833101272583)
    # vllm:request_time_per_output_token_seconds (per-request TPOT) is a different metric
    assert got["itl_seconds_sum"] != pytest.approx(0.013145136714277734)


def test_real_vllm_032_capture_summary_from_zero() -> None:
    after = parse_histograms(_real_capture())
    before = {
        k: Histogram(h.bounds, tuple(0.0 for _ in h.counts), 0.0, 0.0) for k, h in after.items()
    }
    got, notes = summarize_histograms(before, after)
    assert got["server_count_ttft"] == 5.0
    assert got["server_mean_ttft_ms"] == pytest.approx(90.16299247741699 / 5)
    # cumulative 2, 3, 5 at le 0.01, 0.02, 0.04: p50 rank 2.5 -> 10 + 10 * 0.5/1 ms,
    # p90 rank 4.5 -> 20 + 20 * 1.5/2 ms, p99 rank 4.95 -> 20 + 20 * 1.95/2 ms
    assert got["server_p50_ttft_ms"] == pytest.approx(15.0)
    assert got["server_p90_ttft_ms"] == pytest.approx(35.0)
    assert got["server_p99_ttft_ms"] == pytest.approx(39.5)
    assert got["server_count_itl"] == 35.0
    assert not any(k.startswith("server_p") and k.endswith("_itl_ms") for k in got)
    assert (
        "server itl: p50, p90, p99 omitted: all 35 observations in one bucket (0, 0.01] s: "
        "quantiles would only echo the bucket bounds"
    ) in notes
    assert all(note.startswith("server ") for note in notes)


def test_itl_prefers_new_name_over_old() -> None:
    new = _vllm_histogram(
        "vllm:inter_token_latency_seconds", ["0.01", "0.025"], [([3, 4, 4], 0.02)]
    )
    old = _vllm_histogram(
        "vllm:time_per_output_token_seconds", ["0.01", "0.025"], [([1, 1, 2], 0.5)]
    )
    both = parse_histograms(old + new)
    assert both["itl"] == Histogram((0.01, 0.025, INF), (3.0, 4.0, 4.0), 0.02, 4.0)
    flat = parse_metrics(old + new)
    assert (flat["itl_seconds_sum"], flat["itl_seconds_count"]) == (0.02, 4.0)  # not added
    only_old = parse_histograms(old)
    assert only_old["itl"] == Histogram((0.01, 0.025, INF), (1.0, 1.0, 2.0), 0.5, 2.0)
    assert parse_metrics(old)["itl_seconds_count"] == 2.0


def test_unusable_histograms_are_left_out() -> None:
    e2el = "vllm:e2e_request_latency_seconds"
    good = _vllm_histogram("vllm:request_decode_time_seconds", ["1.0"], [([1, 1], 0.5)])
    different_bounds = _vllm_histogram(e2el, ["1.0"], [([1, 1], 0.5)]).replace(
        'engine="0",le="1.0"', 'engine="0",le="2.0"'
    ) + _vllm_histogram(e2el, ["1.0"], [([1, 1], 0.5)]).replace('engine="0"', 'engine="1"')
    no_inf = "\n".join(
        line
        for line in _vllm_histogram(e2el, ["1.0"], [([1, 1], 0.5)]).splitlines()
        if 'le="+Inf"' not in line
    )
    nan_sum = _vllm_histogram(e2el, ["1.0"], [([1, 1], math.nan)])
    for bad in (different_bounds, no_inf + "\n", nan_sum):
        assert set(parse_histograms(good + bad)) == {"decode"}
        assert "e2el_seconds_sum" not in parse_metrics(good + bad)
    with pytest.raises(ValueError):
        parse_histograms("vllm:e2e_request_latency_seconds_bucket{le=0.1 x\n")


def test_histogram_dataclass_validates_shape() -> None:
    with pytest.raises(ValueError):
        Histogram((0.1, INF), (1.0,), 0.0, 1.0)
    with pytest.raises(ValueError):
        Histogram((0.2, 0.1, INF), (0.0, 0.0, 0.0), 0.0, 0.0)
    with pytest.raises(ValueError):
        Histogram((0.1, 0.2), (0.0, 0.0), 0.0, 0.0)
    with pytest.raises(ValueError):
        Histogram((), (), 0.0, 0.0)


def _registry_text(observe: dict[str, list[float]]) -> str:
    """A prometheus_client-made /metrics text: one TTFT histogram, one series per engine."""
    registry = CollectorRegistry()
    hist = PromHistogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        labelnames=["model_name", "engine"],
        buckets=[0.01, 0.025, 0.05, 0.1],
        registry=registry,
    )
    for engine, values in observe.items():
        child = hist.labels(model_name="tiny", engine=engine)  # created at 0, as vLLM does
        for v in values:
            child.observe(v)
    return generate_latest(registry).decode()


# per bucket: (0, 0.01] 1; (0.01, 0.025] 2; (0.025, 0.05] 3; (0.05, 0.1] 3; (0.1, +Inf] 1
OBSERVED = {"0": [0.005, 0.015, 0.02, 0.03], "1": [0.04, 0.045, 0.06, 0.07, 0.08, 0.2]}


def test_quantiles_of_prometheus_client_histogram_match_hand_computation() -> None:
    text = _registry_text(OBSERVED)
    assert "_created" in text and 'engine="1"' in text
    h = parse_histograms(text)["ttft"]
    assert h.bounds == (0.01, 0.025, 0.05, 0.1, INF)
    assert h.counts == (1.0, 3.0, 6.0, 9.0, 10.0)
    assert h.count == 10.0
    assert h.sum == pytest.approx(0.565)
    # rank q * 10; lower bound of the first bucket is 0
    assert histogram_quantile(0.1, h) == (pytest.approx(0.01), None)  # 0 + 0.01 * 1/1
    assert histogram_quantile(0.2, h) == (pytest.approx(0.0175), None)  # 0.01 + 0.015 * 1/2
    assert histogram_quantile(0.5, h) == (pytest.approx(0.025 + 0.025 * 2 / 3), None)
    assert histogram_quantile(0.9, h) == (pytest.approx(0.1), None)  # 0.05 + 0.05 * 3/3
    value, reason = histogram_quantile(0.99, h)  # rank 9.9 > 9: the +Inf bucket
    assert value is None
    assert reason == (
        "falls in the +Inf bucket: 1 of 10 observations are above the largest finite bound 0.1 s"
    )


def test_summarize_histograms_from_prometheus_client_scrapes() -> None:
    before_text = _registry_text({"0": [], "1": []})
    after_text = _registry_text(OBSERVED)
    got, notes = summarize_histograms(parse_histograms(before_text), parse_histograms(after_text))
    assert got == {
        "server_mean_ttft_ms": pytest.approx(56.5),
        "server_count_ttft": 10.0,
        "server_p50_ttft_ms": pytest.approx(25.0 + 25.0 * 2 / 3),
        "server_p90_ttft_ms": pytest.approx(100.0),
    }
    assert notes == [
        "server ttft: p99 omitted: falls in the +Inf bucket: 1 of 10 observations are above "
        "the largest finite bound 0.1 s"
    ]
    # the same mean from the flat time-series keys of the two scrapes
    b, a = parse_metrics(before_text), parse_metrics(after_text)
    assert b["ttft_seconds_count"] == 0.0
    mean_ms = (
        (a["ttft_seconds_sum"] - b["ttft_seconds_sum"])
        / (a["ttft_seconds_count"] - b["ttft_seconds_count"])
        * 1000
    )
    assert mean_ms == pytest.approx(got["server_mean_ttft_ms"])


def test_histogram_delta_subtracts_and_detects_restart() -> None:
    before = Histogram((0.1, 1.0, INF), (2.0, 5.0, 6.0), 3.0, 6.0)
    after = Histogram((0.1, 1.0, INF), (4.0, 9.0, 11.0), 8.0, 11.0)
    assert histogram_delta(before, after) == Histogram((0.1, 1.0, INF), (2.0, 4.0, 5.0), 5.0, 5.0)
    assert histogram_delta(before, before) == Histogram((0.1, 1.0, INF), (0.0, 0.0, 0.0), 0.0, 0.0)
    # server restart: the counters start again from 0
    restarted = Histogram((0.1, 1.0, INF), (1.0, 1.0, 2.0), 0.4, 2.0)
    assert histogram_delta(before, restarted) is None
    # one bucket going down is enough
    assert histogram_delta(before, Histogram((0.1, 1.0, INF), (1.0, 7.0, 7.0), 4.0, 7.0)) is None
    assert histogram_delta(before, Histogram((0.2, 1.0, INF), (2.0, 5.0, 6.0), 3.0, 6.0)) is None
    assert histogram_delta(before, Histogram((1.0, INF), (5.0, 6.0), 3.0, 6.0)) is None


def test_summarize_histograms_restart_gives_note_and_no_keys() -> None:
    before = {"e2el": Histogram((1.0, INF), (10.0, 10.0), 5.0, 10.0)}
    after = {"e2el": Histogram((1.0, INF), (3.0, 3.0), 1.0, 3.0)}
    got, notes = summarize_histograms(before, after)
    assert got == {}
    assert len(notes) == 1 and notes[0].startswith("server e2el: omitted:")
    assert "restart" in notes[0]


def test_all_observations_in_one_bucket() -> None:
    h = Histogram((0.02, 0.04, 0.06, 0.08, INF), (0.0, 0.0, 16.0, 16.0, 16.0), 0.8, 16.0)
    reason = (
        "all 16 observations in one bucket (0.04, 0.06] s: "
        "quantiles would only echo the bucket bounds"
    )
    for q in (0.5, 0.9, 0.99, 1.0):
        assert histogram_quantile(q, h) == (None, reason)
    zero = Histogram(h.bounds, (0.0,) * 5, 0.0, 0.0)
    got, notes = summarize_histograms({"queue": zero}, {"queue": h})
    assert got == {"server_mean_queue_ms": pytest.approx(50.0), "server_count_queue": 16.0}
    assert notes == [f"server queue: p50, p90, p99 omitted: {reason}"]
    first = Histogram((0.001, 0.005, INF), (3.0, 3.0, 3.0), 0.0015, 3.0)
    assert histogram_quantile(0.5, first)[1] == (
        "all 3 observations in one bucket (0, 0.001] s: quantiles would only echo the bucket bounds"
    )


def test_quantile_in_inf_bucket() -> None:
    # all above the largest finite bound
    h = Histogram((0.5, 1.0, INF), (0.0, 0.0, 4.0), 12.0, 4.0)
    value, reason = histogram_quantile(0.5, h)
    assert value is None
    assert reason is not None and "+Inf bucket: 4 of 4 observations" in reason
    assert "bound 1 s" in reason
    # p50 inside, p90/p99 in +Inf: only those two are omitted
    h = Histogram((0.5, 1.0, INF), (6.0, 8.0, 10.0), 9.0, 10.0)
    got, notes = summarize_histograms(
        {"e2el": Histogram(h.bounds, (0.0, 0.0, 0.0), 0.0, 0.0)}, {"e2el": h}
    )
    assert got == {
        "server_mean_e2el_ms": pytest.approx(900.0),
        "server_count_e2el": 10.0,
        "server_p50_e2el_ms": pytest.approx(500.0 * 5 / 6),
    }
    assert notes == [
        "server e2el: p90, p99 omitted: falls in the +Inf bucket: 2 of 10 observations are "
        "above the largest finite bound 1 s"
    ]


def test_quantile_edge_cases_and_errors() -> None:
    empty = Histogram((0.1, INF), (0.0, 0.0), 0.0, 0.0)
    assert histogram_quantile(0.5, empty) == (None, "no observations")
    only_inf = Histogram((INF,), (3.0,), 1.0, 3.0)
    assert histogram_quantile(0.5, only_inf)[0] is None
    broken = Histogram((0.1, 0.2, INF), (5.0, 4.0, 6.0), 1.0, 6.0)
    value, reason = histogram_quantile(0.5, broken)
    assert value is None and reason is not None and "not cumulative" in reason
    h = Histogram((0.1, 0.2, INF), (1.0, 2.0, 2.0), 0.2, 2.0)
    assert histogram_quantile(1.0, h) == (pytest.approx(0.2), None)
    for q in (0.0, -0.1, 1.5, math.nan):
        with pytest.raises(ValueError):
            histogram_quantile(q, h)
    with pytest.raises(ValueError):
        summarize_histograms({}, {}, percentiles=(50, 101))


def test_summarize_histograms_percentile_spelling_and_missing_keys() -> None:
    h = Histogram((0.1, 0.2, INF), (1.0, 2.0, 2.0), 0.2, 2.0)
    zero = Histogram(h.bounds, (0.0, 0.0, 0.0), 0.0, 0.0)
    got, notes = summarize_histograms(
        {"ttft": zero, "decode": zero, "prefill": zero},
        {"ttft": h, "itl": h, "prefill": zero},
        percentiles=(50, 99.9),
    )
    assert set(got) == {
        "server_mean_ttft_ms",
        "server_count_ttft",
        "server_p50_ttft_ms",
        "server_p99.9_ttft_ms",
    }
    assert got["server_p50_ttft_ms"] == pytest.approx(100.0)
    assert got["server_p99.9_ttft_ms"] == pytest.approx(199.8)
    assert sorted(notes) == [
        "server decode: omitted: the histogram is missing or unusable (a NaN sample, an "
        "incomplete label set) in the 'after' scrape",
        "server itl: omitted: the histogram is missing or unusable (a NaN sample, an "
        "incomplete label set) in the 'before' scrape",
        "server prefill: omitted: no observations between the scrapes",
    ]
    assert summarize_histograms({}, {}) == ({}, [])


# -- inconsistent _sum: no mean, a note ---------------------------------------------------

#: vLLM V0's TTFT buckets (vllm/engine/metrics.py of 0.5.x; the bounds of the scrape in
#: vllm-project/vllm#6337).
V0_TTFT_BOUNDS = [
    "0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75",
    "1.0", "2.5", "5.0", "7.5", "10.0",
]  # fmt: skip


def test_ttft_sum_zero_with_observations_gives_no_mean() -> None:
    """vllm-project/vllm#6337 (vLLM 0.5.1, TP 8): every bucket of
    ``vllm:time_to_first_token_seconds`` held all 208 observations from le=0.001 on, "so the
    time values are apparently always 0 seconds" (the latency was miscomputed; fixed by
    vllm-project/vllm#6686, bisected in vllm-project/vllm#8819). Its ``_sum`` did not grow
    while ``_count`` did: 0 s is no TTFT, so the mean is omitted, not reported as 0 ms."""
    name = "vllm:time_to_first_token_seconds"
    before = _vllm_histogram(name, V0_TTFT_BOUNDS, [([0.0] * 17, 0.0)])
    after = _vllm_histogram(name, V0_TTFT_BOUNDS, [([208.0] * 17, 0.0)])
    got, notes = summarize_histograms(parse_histograms(before), parse_histograms(after))
    assert "server_mean_ttft_ms" not in got
    assert got == {"server_count_ttft": 208.0}
    assert notes[0] == (
        "server ttft: mean omitted: _sum did not grow while _count grew by 208: every "
        "observation would be 0 s (a broken histogram, as vLLM 0.5.1's TTFT: "
        "vllm-project/vllm#6337)"
    )
    assert notes[1].startswith("server ttft: p50, p90, p99 omitted: all 208 observations")


def test_decode_sum_zero_is_a_mean_of_zero_for_one_token_requests() -> None:
    """vLLM's decode time is ``last_token_ts - first_token_ts``
    (vllm/v1/metrics/stats.py ``update_from_finished_request``, vLLM 0.32 line 601): exactly
    0 s for requests with one output token, so a decode ``_sum`` of 0 is a true mean of 0."""
    bounds = (0.3, 0.5, INF)
    zero = Histogram(bounds, (0.0, 0.0, 0.0), 0.0, 0.0)
    one_token = Histogram(bounds, (12.0, 12.0, 12.0), 0.0, 12.0)
    got, notes = summarize_histograms({"decode": zero}, {"decode": one_token})
    assert got == {"server_mean_decode_ms": 0.0, "server_count_decode": 12.0}
    assert not any("mean omitted" in n for n in notes)
    # the same shape for the queue (a time that passes) is not a mean
    got, notes = summarize_histograms({"queue": zero}, {"queue": one_token})
    assert "server_mean_queue_ms" not in got and "mean omitted" in notes[0]


def _real_pair(ttft_sum: float | None = None) -> tuple[dict[str, Histogram], dict[str, Histogram]]:
    """The real vLLM 0.32 capture as ``after`` (its TTFT ``_sum`` replaced when given) and
    empty histograms of the same buckets as ``before``."""
    after = parse_histograms(_real_capture())
    if ttft_sum is not None:
        t = after["ttft"]
        after["ttft"] = Histogram(t.bounds, t.counts, ttft_sum, t.count)
    before = {
        k: Histogram(h.bounds, tuple(0.0 for _ in h.counts), 0.0, 0.0) for k, h in after.items()
    }
    return before, after


def test_real_capture_sums_are_consistent() -> None:
    """Every histogram of a real vLLM 0.32 scrape passes the checks: a mean each."""
    before, after = _real_pair()
    got, notes = summarize_histograms(before, after)
    assert {k for k in got if k.startswith("server_mean_")} == {
        f"server_mean_{k}_ms" for k in HISTOGRAMS
    }
    assert not any("mean omitted" in n for n in notes)


@pytest.mark.parametrize(
    ("ttft_sum", "reason"),
    [
        # 5 TTFTs: 2 in (0.005, 0.01], 1 in (0.01, 0.02], 2 in (0.02, 0.04] (the capture)
        (0.0, "_sum did not grow while _count grew by 5"),
        (0.05, "_sum grew by 0.05 s, less than the 5 observations in their buckets add up to "
         "at least (0.06 s)"),
        (0.2, "_sum grew by 0.2 s, more than the 5 observations in their buckets add up to at "
         "most (0.12 s)"),
        (math.inf, "_sum is not finite"),
    ],
)  # fmt: skip
def test_ttft_sum_outside_what_the_buckets_allow(ttft_sum: float, reason: str) -> None:
    before, after = _real_pair(ttft_sum)
    got, notes = summarize_histograms(before, after)
    assert "server_mean_ttft_ms" not in got
    assert got["server_count_ttft"] == 5.0 and got["server_p50_ttft_ms"] == pytest.approx(15.0)
    assert "server_mean_e2el_ms" in got  # the other histograms are unaffected
    (note,) = [n for n in notes if n.startswith("server ttft: mean omitted")]
    assert reason in note


def test_negative_sum_gives_no_mean() -> None:
    before, after = _real_pair(-0.5)
    got, notes = summarize_histograms(before, after)
    assert "server_mean_ttft_ms" not in got and "server_count_ttft" not in got
    assert "server ttft: omitted: _sum is negative (-0.5 s)" in notes
    # negative in both scrapes, growing: still no mean
    t = after["ttft"]
    got, notes = summarize_histograms(
        {"ttft": Histogram(t.bounds, before["ttft"].counts, -1.0, 0.0)}, after
    )
    assert "server_mean_ttft_ms" not in got
    assert "server ttft: mean omitted: _sum is negative (-1 s)" in notes


def test_sum_going_down_while_counts_grow_is_not_a_restart() -> None:
    before, after = _real_pair()
    b = after["e2el"]
    grown = Histogram(b.bounds, tuple(c + 1 for c in b.counts), b.sum - 0.1, b.count + 1)
    got, notes = summarize_histograms({"e2el": b}, {"e2el": grown})
    assert got == {}
    assert notes == [
        "server e2el: omitted: _sum went down by 0.1 s while the counts did not: an "
        "inconsistent _sum"
    ]


def test_count_disagreeing_with_inf_bucket_gives_no_mean() -> None:
    bounds = (0.1, 1.0, INF)
    zero = Histogram(bounds, (0.0, 0.0, 0.0), 0.0, 0.0)
    odd = Histogram(bounds, (2.0, 4.0, 4.0), 1.5, 6.0)
    got, notes = summarize_histograms({"e2el": zero}, {"e2el": odd})
    assert "server_mean_e2el_ms" not in got
    assert "server e2el: mean omitted: _count grew by 6 but the +Inf bucket by 4" in notes
