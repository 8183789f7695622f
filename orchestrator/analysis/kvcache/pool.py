"""The KV cache pool as vLLM 0.32.0 sizes it: groups, bytes per block, blocks, blocks per
request, maximum concurrency, the printed token count, and whether ``max_model_len`` fits.

Sources (``vllm/v1/core/kv_cache_utils.py`` of vLLM 0.32.0 unless named):

- **Groups** (``get_kv_cache_groups`` L2159): one group when every layer has the same
  spec (``is_kv_cache_spec_uniform`` L1171) or the same type (all full attention, or all
  one sliding window: ``UniformTypeKVCacheSpecs``, ``kv_cache_interface.py`` L1225; its
  page is the sum of the layers' pages, L1253); otherwise (a hybrid model) the layers of
  each spec are split into groups of ``group_size`` layers, ``group_size`` the smallest
  spec's layer count, or the largest when that is under 1.5 times the smallest, layer
  ``i`` of a spec going to group ``i % num_groups`` (``_get_kv_cache_groups_uniform_page_size``
  L1362-L1502). Hybrid layers of different page sizes are padded or packed by the
  attention backend's layout (L1292, L1860): not modelled. With
  ``disable_hybrid_kv_cache_manager`` sliding-window layers are allocated as full
  attention (``_promote_local_kv_cache_specs`` L1690).
- **Bytes per block** (``_get_kv_cache_bytes_per_block`` L1520): the largest group's sum
  of page sizes (``page = block_size * bytes per token``, ``kv_cache_interface.py``
  L545-L553), per worker; **blocks** ``available // bytes_per_block``
  (``get_kv_cache_config_from_groups`` L1627), the smallest over PP ranks (L2665), or
  ``num_gpu_blocks_override`` (L1230).
- **Blocks per request** (``get_max_concurrency_for_kv_cache_config`` L1195): the sum
  over groups of ``cdiv(max_memory_usage_bytes, page)``: full attention
  ``cdiv(max_model_len, block_size)`` (``kv_cache_interface.py`` L602-L607); sliding
  window ``cdiv(min(sliding_window - 1 + extra_retained + in_flight, max_model_len),
  block_size) + 1`` (L862-L885), ``in_flight = max_concurrent_batches *
  max_num_batched_tokens`` (``config/vllm.py`` L577-L598).
- **Maximum concurrency** ``num_blocks / blocks_per_request`` and the printed
  ``KV cache size: N tokens`` ``int(max_concurrency * max_model_len)``
  (``get_kv_cache_capacity`` L2300, ``update_kv_cache_capacity`` L2316, printed with
  ``%.2fx`` and ``{:,}``). Older V1 releases printed ``num_blocks // len(groups) *
  block_size`` (``_report_kv_cache_config``); :func:`legacy_printed_tokens` gives it.
- **Fits** (``get_kv_cache_configs`` L2627-L2646): vLLM reserves the null block, so
  ``max_model_len`` fits iff ``(blocks_per_request + 1) * bytes_per_block <= available``,
  i.e. ``blocks_per_request + 1 <= num_blocks``; the largest length that fits is what vLLM
  calls "the estimated maximum model length" (``_estimate_max_model_len_from_groups``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.analysis.kvcache.shapes import (
    KVCacheUnknown,
    KVConfigError,
    KVLayout,
    LayerSpec,
    engine_int,
)

__all__ = ["Group", "Pool", "kv_pool", "legacy_printed_tokens", "pool_shape"]


@dataclass(frozen=True)
class Group:
    """A KV cache group: its attention kind, window, block size and layer indices."""

    kind: str
    sliding_window: int | None
    block_size: int
    layers: tuple[int, ...]

    def blocks_per_request(self, max_model_len: int, in_flight: int, retained: int) -> int:
        if self.kind == "full":
            return math.ceil(max_model_len / self.block_size)
        assert self.sliding_window is not None
        tokens = min(self.sliding_window - 1 + retained + in_flight, max_model_len)
        return math.ceil(tokens / self.block_size) + 1


@dataclass
class Pool:
    """The pool of one engine: groups, bytes per block and blocks of the binding rank."""

    layout: KVLayout
    groups: list[Group]
    bytes_per_block: int
    binding_rank: int
    num_blocks: int
    in_flight_tokens: int
    notes: list[str]

    def blocks_per_request(self, max_model_len: int) -> int:
        retained = self.layout.extra_retained_tokens
        return sum(
            g.blocks_per_request(max_model_len, self.in_flight_tokens, retained)
            for g in self.groups
        )

    def concurrency(self, max_model_len: int) -> float:
        return self.num_blocks / self.blocks_per_request(max_model_len)

    def printed_tokens(self, max_model_len: int) -> int:
        """``KV cache size: N tokens`` as vLLM 0.32.0 prints it."""
        return int(self.num_blocks / self.blocks_per_request(max_model_len) * max_model_len)

    def fits(self, max_model_len: int) -> bool:
        return self.blocks_per_request(max_model_len) + 1 <= self.num_blocks

    def largest(self, requests: int, *, null_block: bool) -> int | None:
        """The largest ``max_model_len`` at which ``requests`` full-length requests fit
        (``requests * blocks_per_request + null_block <= num_blocks``); 0 when not one
        token fits; None when every group is a sliding window (no cap from the KV cache)."""
        if all(g.kind != "full" for g in self.groups):
            return None
        budget = self.num_blocks - (1 if null_block else 0)

        def ok(length: int) -> bool:
            return requests * self.blocks_per_request(length) <= budget

        if not ok(1):
            return 0
        lo, hi = 1, max(1, self.num_blocks) * max(g.block_size for g in self.groups)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo


def legacy_printed_tokens(pool: Pool) -> int:
    """``GPU KV cache size`` as V1 releases before the group-aware count printed it:
    ``num_blocks // len(groups) * min(block_size)`` (``_report_kv_cache_config``)."""
    return pool.num_blocks // len(pool.groups) * min(g.block_size for g in pool.groups)


def _same_type(specs: list[LayerSpec]) -> bool:
    kinds = {s.kind for s in specs}
    if kinds == {"full"}:
        return True
    return kinds == {"sliding"} and len({s.sliding_window for s in specs}) == 1


def _groups(layout: KVLayout, hybrid_manager: bool) -> list[Group]:
    specs = [layer.spec for layer in layout.layers]
    bs = layout.block_size
    kinds = {s.kind for s in specs}
    if not hybrid_manager and kinds == {"full", "sliding"}:
        specs = [LayerSpec("full", s.num_kv_heads, s.head_size, s.head_size_v, s.dtype_bytes,
                           s.state_bytes) for s in specs]  # fmt: skip
    everything = tuple(range(len(specs)))
    if len(set(specs)) == 1 or _same_type(specs):
        first = specs[0]
        return [Group(first.kind, first.sliding_window, bs, everything)]
    if len({s.page_size(bs) for s in specs}) > 1:
        raise KVCacheUnknown(
            ("model",),
            "sliding-window and full-attention layers of different page sizes: vLLM pads or "
            "packs them by the attention backend's layout (kv_cache_utils.py "
            "unify_kv_cache_spec_page_size / _get_packed_kv_cache_groups); not modelled",
        )
    buckets: dict[LayerSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        buckets.setdefault(spec, []).append(i)
    sizes = [len(v) for v in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < group_size * 1.5:
        group_size = max(sizes)
    groups = []
    for spec, idx in buckets.items():
        count = math.ceil(len(idx) / group_size)
        for i in range(count):
            groups.append(Group(spec.kind, spec.sliding_window, bs, tuple(idx[i::count])))
    return groups


def _in_flight(layout: KVLayout, engine: Mapping[str, Any], notes: list[str]) -> int:
    """``max_concurrent_batches * max_num_batched_tokens`` (``config/vllm.py`` L577-L598)."""
    tokens = engine.get("max_num_batched_tokens")
    if tokens is None:
        raise KVCacheUnknown(
            ("engine", "max_num_batched_tokens"),
            "sliding-window layers keep the window plus the tokens in flight "
            "(max_num_batched_tokens per concurrent batch); vLLM's default depends on the "
            "device and the entry point: give it",
        )
    tokens = engine_int(engine, "max_num_batched_tokens", 0)
    pp = layout.pipeline_parallel_size
    async_ = engine.get("async_scheduling")
    if async_ is None:
        spec = layout.speculative or {}
        method = spec.get("method")
        if pp > 1 or method in ("ngram", "suffix", "medusa", "mlp_speculator", "custom_class"):
            async_ = False
        else:
            async_ = True
        notes.append(
            f"async_scheduling not given: vLLM 0.32 turns it {'on' if async_ else 'off'} here "
            "(config/vllm.py L1585-L1644)"
        )
    if async_ and pp > 1:
        raise KVCacheUnknown(
            ("engine", "async_scheduling"),
            "async scheduling with pipeline parallelism: the batches in flight depend on the "
            "model runner version",
        )
    return (2 if async_ else pp) * tokens


def pool_shape(layout: KVLayout, engine: Mapping[str, Any]) -> tuple[list[Group], list[int]]:
    """``(groups, bytes per block on each PP rank)``: the largest group's pages per rank."""
    groups = _groups(layout, hybrid_manager=not engine.get("disable_hybrid_kv_cache_manager"))
    per_rank = []
    for rank in range(layout.pipeline_parallel_size):
        widest = 0
        for g in groups:
            on_rank = [i for i in g.layers if layout.layers[i].pp_rank == rank]
            widest = max(
                widest, sum(layout.layers[i].spec.page_size(g.block_size) for i in on_rank)
            )
        per_rank.append(widest)
    if max(per_rank) <= 0:
        raise KVConfigError(("model",), "no layer holds a KV cache")
    return groups, per_rank


def kv_pool(
    layout: KVLayout,
    engine: Mapping[str, Any],
    available_bytes: int,
) -> Pool:
    """The engine's pool for ``available_bytes`` of KV cache memory on each worker.

    ``engine``: ``disable_hybrid_kv_cache_manager``, ``num_gpu_blocks_override``,
    ``max_num_batched_tokens`` and ``async_scheduling`` (read when a layer slides).
    """
    notes: list[str] = []
    groups, per_rank = pool_shape(layout, engine)
    in_flight = 0
    if any(g.kind == "sliding" for g in groups):
        in_flight = _in_flight(layout, engine, notes)
    bytes_per_block = max(per_rank)
    binding = per_rank.index(bytes_per_block)
    num_blocks = max(0, available_bytes) // bytes_per_block
    if engine.get("num_gpu_blocks_override") is not None:
        num_blocks = engine_int(engine, "num_gpu_blocks_override", 0, low=1)
        notes.append(f"num_gpu_blocks_override: {num_blocks} blocks, whatever the memory")
    return Pool(layout, groups, bytes_per_block, binding, num_blocks, in_flight, notes)
