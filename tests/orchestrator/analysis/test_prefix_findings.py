""":func:`orchestrator.analysis.prefix.hit_rate_finding` weighing the run's server signals.

A measured hit rate above what the prompts allow is not reuse when preempted requests'
recomputed tokens are counted as hits: vllm-project/vllm#25780 ("vLLM counts
re-computation tokens as prefix match": 32.2 % hit rate on a random dataset with no shared
prefix, ``Running: 259 reqs, Waiting: 535 reqs, GPU KV cache usage: 82.3%``), fixed by
vllm-project/vllm#25787 (merged 2025-09-26: 0.2 % after). vLLM 0.32.0 (the engine
environment) books re-scheduled requests apart: ``vllm/v1/metrics/stats.py`` l.146-151
(``PrefixCacheStats.record``: ``if preempted:`` -> ``preempted_queries`` /
``preempted_hits``, then return) and ``vllm/v1/metrics/loggers.py`` l.1166-1171 (the
Prometheus counters get ``.queries`` / ``.hits`` only). The metric keys are those of
:func:`jobs.signals.enginemetrics.summarize_samples` (``num_preemptions_delta``,
``kv_cache_usage_peak``,
``num_requests_waiting_peak``, ``prefix_cache_queries_delta``, ``prefix_cache_hits_delta``).
"""

from __future__ import annotations

import pytest

from orchestrator.analysis.prefix import hit_rate_finding
from orchestrator.analysis.prefix.findings import FIXED_IN

#: The analysis a run keeps (summarize): 100 requests of 1,000 prompt tokens, 30 % reusable.
SUMMARY = {"predicted_hit_rate": 0.3, "queries_tokens": 100_000, "hits_tokens": 30_000}


def _metrics(**kw: float) -> dict[str, float]:
    base = {
        "prefix_cache_queries_delta": 160_000.0,  # 60,000 tokens re-queried after preemption
        "prefix_cache_hits_delta": 80_000.0,  # 50,000 more hits than predicted
        "num_preemptions_delta": 60.0,
        "kv_cache_usage_peak": 1.0,
        "num_requests_waiting_peak": 40.0,
    }
    base.update(kw)
    return base


def test_no_signals_keeps_the_plain_finding() -> None:
    assert hit_rate_finding(0.5, 0.45) is None
    high = hit_rate_finding(0.1, 0.5)
    assert high is not None and high.code == "hit_rate_above_prediction"
    assert "preempted" in high.message and high.explanation is None
    assert set(high.evidence) == {
        "predicted_hit_rate",
        "measured_hit_rate",
        "difference",
        "tolerance",
    }


def test_preemption_recompute_explains_the_excess_on_an_old_vllm() -> None:
    """vLLM 0.10.1.1 counts re-queried tokens: the counters queried 60,000 tokens beyond the
    prompts, enough for the 50,000 excess hit tokens."""
    found = hit_rate_finding(
        0.3, 0.5, tolerance=0.2 - 1e-9, metrics=_metrics(), summary=SUMMARY, vllm_version="0.10.1.1"
    )
    assert found is not None and found.code == "hit_rate_above_prediction"
    assert found.explanation == "preemption_recompute"
    assert "explained by preemption recompute" in found.message
    assert "60 preemption(s)" in found.message and "KV cache usage peaked at 100%" in found.message
    assert "60,000 tokens beyond the prompts" in found.message and "50,000" in found.message
    assert "vllm-project/vllm#25780" in found.message
    ev = found.evidence
    assert ev["num_preemptions"] == 60 and ev["vllm_version"] == "0.10.1.1"
    assert ev["queries_beyond_prompts_tokens"] == 60_000
    assert ev["hits_beyond_prediction_tokens"] == 50_000
    assert found.action is not None and "max_num_seqs" in found.action


def test_part_of_the_excess_left_unexplained() -> None:
    m = _metrics(prefix_cache_queries_delta=110_000.0)  # 10,000 re-queried < 50,000 excess
    found = hit_rate_finding(0.3, 0.5, metrics=m, summary=SUMMARY, vllm_version="0.9.2")
    assert found is not None and found.explanation == "preemption_recompute_possible"
    assert "only part of the excess" in found.message


def test_a_fixed_vllm_does_not_count_preempted_tokens() -> None:
    found = hit_rate_finding(0.3, 0.5, metrics=_metrics(), summary=SUMMARY, vllm_version="0.32.0")
    assert found is not None and found.explanation == "not_preemption"
    assert "does not count preempted" in found.message and "#25787" in found.message
    assert "reset" in found.message
    assert FIXED_IN <= (0, 32, 0)


def test_unknown_version_says_may() -> None:
    """vLLM 0.11.0 was cut the week of the fix; an unknown version likewise: "may"."""
    for version in (None, "0.11.0"):
        found = hit_rate_finding(0.3, 0.5, metrics=_metrics(), vllm_version=version)
        assert found is not None and found.explanation == "preemption_recompute_possible"
        assert "may be preemption recompute" in found.message


def test_no_extra_queries_means_preemptions_were_not_counted() -> None:
    """A counting vLLM adds a resumed request's whole lookup to the queries; none beyond the
    prompts with 60 preemptions: this engine does not count them."""
    m = _metrics(prefix_cache_queries_delta=100_000.0)
    found = hit_rate_finding(0.3, 0.5, metrics=m, summary=SUMMARY)
    assert found is not None and found.explanation == "not_preemption"
    assert "no more tokens than the prompts hold" in found.message


def test_full_cache_without_a_preemption_counter_may_be_recompute() -> None:
    m = _metrics(kv_cache_usage_peak=0.99)
    del m["num_preemptions_delta"]
    found = hit_rate_finding(0.3, 0.5, metrics=m, summary=SUMMARY)
    assert found is not None and found.explanation == "preemption_recompute_possible"
    assert "preemptions were not counted" in found.message
    assert (
        "KV cache usage peaked at 99%" in found.message and "40 request(s) waited" in found.message
    )
    assert "num_preemptions" not in found.evidence  # not measured: absent, never 0


def test_no_preemption_rules_it_out() -> None:
    m = _metrics(num_preemptions_delta=0.0, kv_cache_usage_peak=0.4, num_requests_waiting_peak=0.0)
    found = hit_rate_finding(0.3, 0.5, metrics=m, summary=SUMMARY, vllm_version="0.10.0")
    assert found is not None and found.explanation == "not_preemption"
    assert "no request was preempted" in found.message


def test_a_list_sent_several_times_is_not_read_as_recompute() -> None:
    """Capacity steps replay the list: 3x the prompts' tokens queried is not preemption."""
    m = _metrics(prefix_cache_queries_delta=300_000.0, prefix_cache_hits_delta=150_000.0)
    found = hit_rate_finding(0.3, 0.5, metrics=m, summary=SUMMARY, vllm_version="0.10.1")
    assert found is not None and found.explanation == "preemption_recompute_possible"
    assert "token_counts_not_compared" in found.evidence
    assert "beyond the prompts" not in found.message


def test_below_prediction_with_a_full_cache_is_eviction() -> None:
    found = hit_rate_finding(0.6, 0.2, metrics=_metrics(), summary=SUMMARY)
    assert found is not None and found.code == "hit_rate_below_prediction"
    assert found.explanation == "eviction_likely" and "evicted" in found.message
    assert found.evidence["difference"] == pytest.approx(-0.4)
    plain = hit_rate_finding(0.6, 0.2)
    assert plain is not None and plain.explanation is None and plain.action is None
