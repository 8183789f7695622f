"""Prediction: the prefix cache hit rate vLLM's V1 engine reaches on prompts sent in
order (whole blocks, at most ``n - 1`` tokens looked up; see
:mod:`orchestrator.analysis.prefix` for the vLLM sources it reproduces).
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.analysis.prefix.schemas import (
    DEFAULT_BLOCK_SIZE,
    HitRatePrediction,
    RequestPrediction,
)


def shared_prefix_length(token_lists: Sequence[Sequence[int]]) -> int:
    """Length (tokens) of the longest token prefix common to every list (0 for none)."""
    if not token_lists:
        return 0
    first = token_lists[0]
    n = min(len(t) for t in token_lists)
    for i in range(n):
        tok = first[i]
        if any(t[i] != tok for t in token_lists):
            return i
    return n


class _BlockCache:
    """vLLM's prefix cache without eviction: full blocks keyed by (parent block, exact
    token ids), each with the request that first cached it and whether it then held
    generated tokens."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.nodes: dict[tuple[int, tuple[int, ...]], int] = {}
        self.owner: list[int] = []
        self.from_generated: list[bool] = []

    def lookup(self, toks: Sequence[int]) -> tuple[int, int, int | None]:
        """``(hit blocks, of them first cached holding generated tokens, the request that
        cached the last hit block)`` for a prompt: at most ``(n - 1) // block_size``."""
        bs = self.block_size
        parent, hit_blocks, generated_blocks = -1, 0, 0
        reused: int | None = None
        for b in range(max(0, (len(toks) - 1)) // bs):
            node = self.nodes.get((parent, tuple(toks[b * bs : (b + 1) * bs])))
            if node is None:
                break
            parent = node
            hit_blocks += 1
            generated_blocks += self.from_generated[node]
            reused = self.owner[node]
        return hit_blocks, generated_blocks, reused

    def insert(self, j: int, held: Sequence[int], n: int) -> None:
        """Cache request ``j``'s full blocks of ``held`` (its ``n`` prompt tokens, then
        what it generated)."""
        bs = self.block_size
        parent = -1
        for b in range(len(held) // bs):
            key = (parent, tuple(held[b * bs : (b + 1) * bs]))
            node = self.nodes.get(key)
            if node is None:
                node = len(self.owner)
                self.nodes[key] = node
                self.owner.append(j)
                self.from_generated.append((b + 1) * bs > n)
            parent = node


def predict_hit_rate(
    token_lists: Sequence[Sequence[int]],
    block_size: int = DEFAULT_BLOCK_SIZE,
    generated: Sequence[Sequence[int] | None] | None = None,
) -> HitRatePrediction:
    """Predict vLLM APC hits for prompts sent in order to a fresh engine.

    Reproduces ``KVCacheManager.get_computed_blocks`` (vLLM V1): request ``j`` of ``n_j``
    prompt tokens hits the longest chain of whole blocks, at most ``(n_j - 1) //
    block_size`` of them, already cached by an earlier request; then its ``n_j //
    block_size`` full prompt blocks are cached. With the ``g_j >= 1`` tokens it generated
    (``generated[j]``), ``(n_j + g_j - 1) // block_size`` full blocks of prompt + generated
    tokens are cached instead: vLLM hashes the blocks of ``all_token_ids``, output tokens
    included (``vllm/v1/request.py`` ``append_output_token_ids`` -> ``update_block_hashes``;
    ``kv_cache_utils.py`` ``request_block_hasher``), and computes all but the last sampled
    token. ``queries`` adds ``n_j``, ``hits`` the hit tokens (``PrefixCacheStats.record``).
    The cache is unbounded (no eviction). Blocks are keyed by (parent block, exact token
    ids), so no hash collisions.

    Args:
        token_lists: prompt token ids per request, in the order sent.
        block_size: tokens per KV cache block (vLLM ``--block-size``, default 16).
        generated: per request, the token ids the engine generated for it (None or empty:
            unknown, only its prompt blocks are counted).

    One pass computes every figure: each request's hit tokens split by where the blocks
    come from (the prefix all prompts share, earlier prompts, tokens an earlier request
    generated), and the totals as their sums, so a headline never disagrees with the
    requests it sums.

    Returns:
        :class:`HitRatePrediction` (tokens; ``hit_rate`` = hits / queries, 0 when empty).

    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    shared = shared_prefix_length(token_lists)
    shortest = min((len(t) for t in token_lists), default=0)
    reusable = block_size * (max(0, min(shared, shortest - 1)) // block_size)
    cache = _BlockCache(block_size)
    per: list[RequestPrediction] = []
    counted: list[int] = []
    for j, toks in enumerate(token_lists):
        n = len(toks)
        hit_blocks, generated_blocks, reused = cache.lookup(toks)
        gen = list(generated[j] or []) if generated is not None and j < len(generated) else []
        if gen:
            counted.append(j)
        cache.insert(j, [*toks, *gen][: n + len(gen) - 1] if gen else list(toks), n)
        cached = hit_blocks * block_size
        per.append(
            RequestPrediction(
                index=j,
                prompt_tokens=n,
                cached_tokens=cached,
                reused_from=reused,
                cached_shared_prefix_tokens=min(cached, reusable),
                cached_generated_tokens=generated_blocks * block_size,
            )
        )
    queries = sum(p.prompt_tokens for p in per)
    hits = sum(p.cached_tokens for p in per)
    return HitRatePrediction(
        block_size=block_size,
        queries_tokens=queries,
        hits_tokens=hits,
        hit_rate=hits / queries if queries else 0.0,
        per_request=per,
        shared_prefix_tokens=shared,
        reusable_prefix_tokens=reusable,
        generated_tokens_counted=counted,
    )
