"""The engine side of the stub server (:mod:`jobs.stub.stubserver`), simulated: its service
slots (capacity mode, :class:`Slots`) and vLLM's automatic prefix caching
(:class:`PrefixCache`).

The stub (with ``prefix_cache=True``) looks every request up in :class:`PrefixCache` when
its body has arrived. Tokens are the stub's (:func:`prompt_token_list`: a BOS token,
then the prompt's whitespace-separated words), cut into blocks of ``block_size``
tokens whose hashes chain (each block's hash covers its parent's, as vLLM's block
hashes do, ``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``). A lookup finds
the longest run of cached full blocks, at most ``prompt_tokens - 1`` tokens (vLLM
always computes the last token: ``max_cache_hit_length = request.num_tokens - 1``,
``vllm/v1/core/kv_cache_manager.py``), counts ``queries += prompt_tokens`` and
``hits += cached`` (``PrefixCacheStats.record``, ``vllm/v1/metrics/stats.py``), then
caches the request's full blocks. Nothing is evicted; :meth:`PrefixCache.clear` is
the reset. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

__all__ = ["PrefixCache", "Slots", "prompt_token_list"]


def prompt_token_list(body: dict[str, Any]) -> list[str]:
    """The stub's tokens of a request body: a BOS token, then the whitespace-separated
    words of ``prompt`` (a token id is one token) or of every message's text."""
    tokens = ["<s>"]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tokens + prompt.split()
    if isinstance(prompt, list):  # token ids, or a list of strings
        for p in prompt:
            tokens += p.split() if isinstance(p, str) else [f"#{p}"]
        return tokens
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            tokens += content.split()
        elif isinstance(content, list):  # OpenAI content parts
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    tokens += part["text"].split()
    return tokens


class PrefixCache:
    """Cached blocks (chained hashes) and vLLM's two counters, in tokens."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: set[int] = set()
        self.queries = 0
        self.hits = 0

    def _hashes(self, tokens: list[str]) -> list[int]:
        out, parent, size = [], 0, self.block_size
        for i in range(len(tokens) // size):
            parent = hash((parent, tuple(tokens[i * size : (i + 1) * size])))
            out.append(parent)
        return out

    def lookup_and_insert(self, tokens: list[str]) -> int:
        """Cached tokens found for ``tokens`` (at most ``len - 1``); then cache its blocks."""
        hashes = self._hashes(tokens)
        usable = (len(tokens) - 1) // self.block_size
        hit = 0
        while hit < usable and hashes[hit] in self.blocks:
            hit += 1
        cached = hit * self.block_size
        self.queries += len(tokens)
        self.hits += cached
        self.blocks.update(hashes)
        return cached

    def clear(self) -> None:
        """Forget every block (the counters keep counting, as vLLM's do)."""
        self.blocks.clear()

    def metrics_lines(self, label: str) -> list[str]:
        """``vllm:prefix_cache_queries_total`` / ``_hits_total`` with vLLM's HELP texts
        (``vllm/v1/metrics/loggers.py``); ``label`` is the ``{...}`` label set."""
        lines = []
        for name, help_text, value in (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                self.queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                self.hits,
            ),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            lines.append(f"{name}_total{label} {value}.0")
        return lines


class Slots:
    """``n`` service slots handed out in arrival order (FIFO); event-loop thread only."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.free = n
        self.queue: deque[asyncio.Future[None]] = deque()

    @property
    def busy(self) -> int:
        return self.n - self.free

    async def acquire(self) -> None:
        if self.free > 0 and not self.queue:
            self.free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot just as it was cancelled: pass it on
            else:
                self.queue.remove(fut)
            raise

    def release(self) -> None:
        while self.queue:
            fut = self.queue.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1
