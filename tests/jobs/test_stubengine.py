"""The stub server's simulated prefix cache (:mod:`jobs.stub.stubengine`) against vLLM's rules.

vLLM caches full blocks only, chains their hashes (a block matches only after the same
blocks before it: vllm/v1/core/kv_cache_utils.py ``hash_block_tokens``), caps a hit at
``num_tokens - 1`` (``max_cache_hit_length``, vllm/v1/core/kv_cache_manager.py) and
counts ``queries += num_tokens``, ``hits += cached`` per new request
(``PrefixCacheStats.record``, vllm/v1/metrics/stats.py); its counters' HELP texts say
"tokens", which :func:`jobs.signals.enginemetrics.parse_metrics` reads as token-counted.
"""

from __future__ import annotations

import json
import urllib.request

from jobs.signals.enginemetrics import parse_metrics
from jobs.stub.stubengine import PrefixCache, prompt_token_list
from jobs.stub.stubserver import StubServer


def _words(n: int, tag: str = "w") -> list[str]:
    return ["<s>"] + [f"{tag}{i}" for i in range(n - 1)]


def test_full_blocks_chained_and_capped() -> None:
    cache = PrefixCache(block_size=4)
    assert cache.lookup_and_insert(_words(10)) == 0  # 2 full blocks cached
    assert cache.lookup_and_insert(_words(10)) == 8  # both, the 2 tokens after are not full
    assert cache.lookup_and_insert(_words(8)) == 4  # capped at 7 tokens: one block
    other_start = ["<s>", "x", *_words(10)[2:]]
    assert cache.lookup_and_insert(other_start) == 0  # the second block's parent differs
    assert (cache.queries, cache.hits) == (38, 12)
    cache.clear()
    assert cache.lookup_and_insert(_words(10)) == 0
    assert (cache.queries, cache.hits) == (48, 12)  # counters keep counting, as vLLM's
    values = parse_metrics("\n".join(cache.metrics_lines('{engine="0"}')) + "\n")
    assert (values["prefix_cache_queries"], values["prefix_cache_hits"]) == (48.0, 12.0)


def test_tokens_of_a_body() -> None:
    assert prompt_token_list({"prompt": "a b  c"}) == ["<s>", "a", "b", "c"]
    assert prompt_token_list({"prompt": [5, 6]}) == ["<s>", "#5", "#6"]
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x y"}]}]}
    assert prompt_token_list(body) == ["<s>", "x", "y"]


def _chat(base: str, text: str) -> dict[str, object]:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        usage: dict[str, object] = json.loads(resp.read())["usage"]
    return usage


def _reset(base: str) -> None:
    req = urllib.request.Request(base + "/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def test_stub_reset_empties_or_keeps_the_cache() -> None:
    text = " ".join(f"w{i}" for i in range(40))
    for keeps, after_reset in ((False, 0), (True, 40)):  # 41 tokens: 5 blocks of 8
        with StubServer(0.0, 0.0, prefix_cache=True, reset_keeps_cache=keeps, block_size=8) as s:
            assert _chat(s.base_url, text)["prompt_tokens_details"] == {"cached_tokens": 0}
            assert _chat(s.base_url, text)["prompt_tokens_details"] == {"cached_tokens": 40}
            _reset(s.base_url)
            got = _chat(s.base_url, text)["prompt_tokens_details"]
            assert got == {"cached_tokens": after_reset}
    with StubServer(0.0, 0.0, report_cached_tokens=False) as s:
        assert "prompt_tokens_details" not in _chat(s.base_url, text)
