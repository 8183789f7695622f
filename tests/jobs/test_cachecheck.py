"""Tests of :mod:`jobs.signals.cachecheck`: the warm-cache rule on records and scrapes.

The shapes are vLLM's: per-request ``usage.prompt_tokens_details.cached_tokens``
(``PrefillStats.num_cached_tokens`` of the request's first scheduling,
vllm/v1/metrics/stats.py; reported only with ``--enable-prompt-tokens-details``, and
omitted when 0 by older ``serving_chat.py``: ``if self.enable_prompt_tokens_details and
num_cached_tokens``), and the ``vllm:prefix_cache_queries_total`` /
``vllm:prefix_cache_hits_total`` counters (tokens; early V1 counted blocks under
``vllm:gpu_prefix_cache_*``: /work/shared/cases/metrics/early_v1_block_units). The
counters of a real vLLM 0.32 CPU server after 5 requests sharing a prefix are in
``data/metrics/vllm032_cpu.txt``. The warm cache itself is vllm-project/vllm#54227
(TTFT 49x, throughput 2.32x) and vllm-project/vllm#52884.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.schemas import MetricSample, RequestRecord
from jobs.signals.cachecheck import (
    Scrape,
    cached_tokens_signal,
    check,
    combine,
    counter_signal,
    first_wave,
)
from jobs.signals.enginemetrics import parse_metrics

DATA = Path(__file__).parent / "data" / "metrics"


def _rec(
    index: int,
    start: float,
    ttft: float | None = 0.05,
    cached: int | None = None,
    prompt: int | None = 100,
    warmup: bool = False,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        warmup=warmup,
        success=ttft is not None,
        start_s=start,
        ttft_s=ttft,
        e2el_s=None if ttft is None else ttft + 0.1,
        prompt_tokens=prompt,
        cached_tokens=cached,
    )


def _closed_loop_1(cached: list[int | None]) -> list[RequestRecord]:
    """Concurrency 1: each request sent when the previous one finished (0.15 s each)."""
    return [_rec(i, 1.0 + 0.15 * i, cached=c) for i, c in enumerate(cached)]


def _burst(cached: list[int | None], prompt: int = 100) -> list[RequestRecord]:
    """Concurrency 4: four requests sent within 2 ms, the first token 50 ms later; then
    one request per finished one."""
    out = [_rec(i, 1.0 + 0.0005 * i, cached=c, prompt=prompt) for i, c in enumerate(cached[:4])]
    out += [_rec(4 + i, 1.16 + 0.1 * i, cached=c, prompt=prompt) for i, c in enumerate(cached[4:])]
    return out


def _sample(t: float, phase: str = "during", **values: float) -> MetricSample:
    return MetricSample(t_s=t, phase=phase, values=values)  # type: ignore[arg-type]


# -- the first wave -------------------------------------------------------------------------


def test_first_wave_is_what_was_sent_before_the_first_token() -> None:
    assert [r.index for r in first_wave(_closed_loop_1([0, 0, 0]))] == [0]
    assert [r.index for r in first_wave(_burst([0] * 6))] == [0, 1, 2, 3]
    # warm-ups are not measured; a failed request without a first token still counts
    records = [_rec(0, 0.0, warmup=True), _rec(1, 1.0, ttft=None), _rec(2, 1.01)]
    assert [r.index for r in first_wave(records)] == [1, 2]
    # nothing got a first token: every measured request may have been scheduled first
    assert len(first_wave([_rec(0, 1.0, ttft=None), _rec(1, 3.0, ttft=None)])) == 2


# -- signal 1: cached tokens ----------------------------------------------------------------


def test_cached_tokens_concurrency_1() -> None:
    # the warm-up's 64-token prefix was still cached: the first measured request found it
    sig, ev = cached_tokens_signal(_closed_loop_1([64, 64, 64]), reports_cached_tokens=True)
    assert sig == "contaminated" and ev["cached_tokens_first_request"] == 64
    assert ev["first_wave"] == 1
    # the first found nothing; the later ones hit what it put there: clean
    sig, ev = cached_tokens_signal(_closed_loop_1([0, 64, 64]), reports_cached_tokens=True)
    assert sig == "clean" and ev["cached_tokens_first_request"] == 0


def test_cached_tokens_sent_at_once() -> None:
    # all four sent at once found cached tokens: whichever vLLM scheduled first did too
    sig, ev = cached_tokens_signal(_burst([48, 64, 64, 64, 64]), reports_cached_tokens=True)
    assert sig == "contaminated" and ev["cached_tokens_first_request"] == 48
    assert ev["first_wave_cached_tokens"] == [48, 64, 64, 64]
    # one of them computed the prefix and the others hit its blocks (vLLM V1 caches full
    # blocks when it allocates them, so requests of one step share them): not provable
    sig, _ = cached_tokens_signal(_burst([64, 0, 64, 64, 64]), reports_cached_tokens=True)
    assert sig == "inconclusive"
    sig, _ = cached_tokens_signal(_burst([0, 0, 0, 0, 64]), reports_cached_tokens=True)
    assert sig == "clean"


def test_cached_tokens_not_reported() -> None:
    # vLLM without --enable-prompt-tokens-details: no prompt_tokens_details at all
    sig, ev = cached_tokens_signal(_closed_loop_1([None, None]), reports_cached_tokens=False)
    assert sig == "unavailable" and ev["cached_tokens_first_request"] is None
    # older vLLM with the flag: 0 left out; known to report (others did): missing = 0
    sig, _ = cached_tokens_signal(_closed_loop_1([None, 64]), reports_cached_tokens=True)
    assert sig == "clean"
    sig, _ = cached_tokens_signal(_burst([None, 64, 64, 64]), reports_cached_tokens=False)
    assert sig == "inconclusive"
    assert cached_tokens_signal([], reports_cached_tokens=True)[0] == "unavailable"


# -- signal 2: the /metrics counters --------------------------------------------------------


def test_counters_one_request_sent() -> None:
    records = _closed_loop_1([None, None, None])
    before = _sample(0.9, "before", prefix_cache_queries=1000, prefix_cache_hits=400)
    # scraped after the first request was sent, before the second: it hit 64 tokens
    hit = Scrape(_sample(1.05, prefix_cache_queries=1100, prefix_cache_hits=464), 1.06)
    sig, ev = counter_signal(before, [hit], records)
    assert sig == "contaminated"
    assert ev | {"scrape_t_s": 1.05} == {
        "unit": "tokens",
        "scrape_t_s": 1.05,
        "phase": "during",
        "requests_sent": 1,
        "hits": 64.0,
        "queries": 100.0,
        "self_hit_bound": 0.0,
    }
    # looked up (queries grew), found nothing
    miss = Scrape(_sample(1.05, prefix_cache_queries=1100, prefix_cache_hits=400), 1.06)
    assert counter_signal(before, [miss], records)[0] == "clean"
    # not looked up yet: no information
    early = Scrape(_sample(1.0, prefix_cache_queries=1000, prefix_cache_hits=400), 1.001)
    assert counter_signal(before, [early], records)[0] == "inconclusive"
    # scraped before anything was sent: skipped (hits then are not the run's)
    idle = Scrape(_sample(0.95, prefix_cache_queries=1100, prefix_cache_hits=500), 0.96)
    assert counter_signal(before, [idle], records)[0] == "unavailable"


def test_counters_self_hit_bound_with_several_requests() -> None:
    records = _burst([None] * 4, prompt=100)
    before = _sample(0.9, "before", prefix_cache_queries=0, prefix_cache_hits=0)
    # four 100-token prompts can hit at most 3 x 99 tokens among themselves
    at_bound = Scrape(_sample(1.1, prefix_cache_queries=400, prefix_cache_hits=297), 1.11)
    assert counter_signal(before, [at_bound], records)[0] == "inconclusive"
    above = Scrape(_sample(1.1, prefix_cache_queries=400, prefix_cache_hits=298), 1.11)
    sig, ev = counter_signal(before, [above], records)
    assert sig == "contaminated" and ev["self_hit_bound"] == 297.0 and ev["requests_sent"] == 4
    # some versions count a preempted request's recomputed blocks as hits: no proof then
    preempted = _sample(1.1, prefix_cache_queries=400, prefix_cache_hits=298, num_preemptions=1)
    before_p = _sample(
        0.9, "before", prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0
    )
    assert counter_signal(before_p, [Scrape(preempted, 1.11)], records)[0] == "inconclusive"
    # a prompt size unknown (a failed request without usage): no bound
    records[1] = _rec(1, 1.0005, ttft=None, prompt=None)
    assert counter_signal(before, [above], records)[0] == "inconclusive"
    # the after scrape with no hit at all: nothing of the phase found anything
    after = Scrape(_sample(2.0, "after", prefix_cache_queries=400, prefix_cache_hits=0), 2.01)
    assert counter_signal(before, [after], records)[0] == "clean"


def test_counters_of_a_real_clean_vllm_run_are_within_the_bound() -> None:
    """vLLM 0.32 CPU, 5 requests (concurrency 2) sharing a ~470-token system prompt on a
    fresh server: 2373 tokens queried, 1536 hit; all hits are the run's own."""
    after_values = parse_metrics((DATA / "vllm032_cpu.txt").read_text())
    assert (after_values["prefix_cache_queries"], after_values["prefix_cache_hits"]) == (
        2373.0,
        1536.0,
    )
    prompts = [475, 474, 475, 474, 475]
    records = [_rec(0, 1.0, prompt=prompts[0]), _rec(1, 1.001, prompt=prompts[1])]
    records += [_rec(2 + i, 1.2 + 0.1 * i, prompt=p) for i, p in enumerate(prompts[2:])]
    before = _sample(0.5, "before", prefix_cache_queries=0.0, prefix_cache_hits=0.0)
    after = Scrape(MetricSample(t_s=2.0, phase="after", values=after_values), 2.01)
    sig, ev = counter_signal(before, [after], records)
    assert sig == "inconclusive" and ev["unit"] == "tokens"
    result = check(records, before, [after], reports_cached_tokens=False, reset_ok=True)
    assert result["status"] == "unknown"


def test_counters_in_blocks() -> None:
    """Early V1 counted blocks (HELP "... queried blocks"): comparable with no prompt size,
    so only a hit while one request was sent proves anything."""
    text = (DATA / "early_v1_block_units.txt").read_text()
    values = parse_metrics(text)
    assert "prefix_cache_hits_blocks" in values and "prefix_cache_hits" not in values
    before = MetricSample(t_s=0.9, phase="before", values=values)
    grown = {
        **values,
        "prefix_cache_hits_blocks": values["prefix_cache_hits_blocks"] + 4,
        "prefix_cache_queries_blocks": values["prefix_cache_queries_blocks"] + 7,
    }
    one = Scrape(MetricSample(t_s=1.05, phase="during", values=grown), 1.06)
    sig, ev = counter_signal(before, [one], _closed_loop_1([None, None]))
    assert sig == "contaminated" and ev["unit"] == "blocks"
    assert counter_signal(before, [one], _burst([None] * 4))[0] == "inconclusive"


def test_no_counters() -> None:
    before = _sample(0.9, "before", num_requests_running=0)
    after = Scrape(_sample(2.0, "after", num_requests_running=0), 2.01)
    assert counter_signal(before, [after], _closed_loop_1([0]))[0] == "unavailable"
    assert counter_signal(None, [after], _closed_loop_1([0]))[0] == "unavailable"


# -- the status -------------------------------------------------------------------------------


def test_status_and_note() -> None:
    warm = check(_closed_loop_1([64, 64]), None, [], reports_cached_tokens=True, reset_ok=True)
    assert warm["status"] == "contaminated"
    assert warm["cached_tokens_first_request"] == 64
    assert warm["note"].startswith(
        "warm cache: the first measured request found 64 or more prompt tokens already cached "
        "(POST /reset_prefix_cache answered success, yet the cache kept blocks"
    )
    assert "restart the vLLM server for each run" in warm["note"]
    clean = check(_closed_loop_1([0, 64]), None, [], reports_cached_tokens=True)
    assert clean["status"] == "clean"
    # neither signal: unknown, never clean
    unknown = check(_closed_loop_1([None, None]), None, [], reset_ok=True)
    assert unknown["status"] == "unknown"
    assert "--enable-prompt-tokens-details" in unknown["note"]
    assert "no prefix cache counters" in unknown["note"]
    # prefix caching off: nothing can be cached
    off = check(_closed_loop_1([None]), None, [], prefix_caching_off=True)
    assert off["status"] == "clean" and "prefix caching is off" in off["note"]
    # one signal proves contamination, the other shows a clean first request: contaminated
    records = _closed_loop_1([0, 0, 0])
    before = _sample(0.9, "before", prefix_cache_queries=0, prefix_cache_hits=0)
    scrape = Scrape(_sample(2.0, "after", prefix_cache_queries=300, prefix_cache_hits=250), 2.01)
    both = check(records, before, [scrape], reports_cached_tokens=True)
    assert both["status"] == "contaminated"
    assert both["cached_tokens"]["signal"] == "clean"
    assert both["counters"]["signal"] == "contaminated" and both["counter_hits"] == 250.0


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        (["clean"], "clean"),
        (["clean", "clean"], "clean"),
        (["clean", "unknown"], "unknown"),
        (["unknown", "contaminated", "clean"], "contaminated"),
    ],
)
def test_combine_phases(statuses: list[str], expected: str) -> None:
    checks = [{"status": s, "note": f"{s} note"} for s in statuses]
    got = combine(checks)
    assert got["status"] == expected
    if len(statuses) > 1:
        assert got["phases"] == statuses
    if expected == "contaminated":
        assert got["note"] == "phase 2: contaminated note"
    assert combine([]) == {}


def test_failed_first_wave_request_is_unknown_not_clean() -> None:
    """vLLM sends usage (prompt_tokens_details.cached_tokens) with the final chunk only
    (``if self.enable_prompt_tokens_details and num_cached_tokens:``, module docstring): a
    request whose stream broke carries none, so "missing means 0" holds only for
    successful requests (issue #16 trial)."""
    recs = [
        RequestRecord(index=0, success=False, error="stream broke", start_s=0.0, prompt_tokens=500),
        RequestRecord(
            index=1, success=True, start_s=0.0, ttft_s=0.2, prompt_tokens=500, cached_tokens=0
        ),
    ]
    assert check(recs, None, [], reports_cached_tokens=True)["status"] == "unknown"
    ok = [recs[1], RequestRecord(index=2, success=True, start_s=0.0, ttft_s=0.3, prompt_tokens=9)]
    assert check(ok, None, [], reports_cached_tokens=True)["status"] == "clean"
