"""The public estimates: bytes per token, the KV cache an engine will print, what fits.

Units: bytes are ``int`` bytes, ``*_gib`` values GiB (2**30 bytes), lengths tokens.
Formulas and their vLLM sources: :mod:`.shapes`, :mod:`.drafter`, :mod:`.pool`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from orchestrator.analysis.kvcache.keys import ignored_engine_keys, ignored_spec_keys
from orchestrator.analysis.kvcache.layers import kv_layout
from orchestrator.analysis.kvcache.pool import Pool, kv_pool, pool_shape
from orchestrator.analysis.kvcache.shapes import (
    KVCacheUnknown,
    KVConfigError,
    KVLayout,
    Layer,
    LayerSpec,
    engine_int,
)

__all__ = [
    "FIT_ADVICE",
    "GIB",
    "MODELLED_VLLM_VERSION",
    "available_kv_bytes",
    "estimate_kv_cache",
    "kv_bytes_per_token",
    "max_fitting_context",
]

GIB = 2**30
#: The vLLM release whose sources the formulas follow.
MODELLED_VLLM_VERSION = "0.32.0"

FIT_ADVICE = (
    "lower max_model_len to at most the KV cache token capacity, or raise "
    "gpu_memory_utilization, or add GPUs (TP divides KV heads per rank)"
)


def _given_layout(per_token: int, engine: Mapping[str, Any]) -> KVLayout:
    """A one-layer stand-in for a given bytes-per-token figure (one full-attention group)."""
    if isinstance(per_token, bool) or not isinstance(per_token, int) or per_token < 1:
        raise KVConfigError(
            ("kv_bytes_per_token",), f"must be a whole number >= 1, got {per_token!r}"
        )
    spec = LayerSpec("full", 1, per_token, 0, 1)
    return KVLayout(
        layers=[Layer(spec, 0, "given", per_token)],
        block_size=engine_int(engine, "block_size", 16),
        tensor_parallel_size=engine_int(engine, "tensor_parallel_size", 1),
        pipeline_parallel_size=1,
        num_hidden_layers=0,
        total_kv_heads=0,
        kv_heads_per_rank=0,
        head_dim=0,
        dtype_bytes=0,
        kv_cache_dtype=str(engine.get("kv_cache_dtype") or "auto"),
        mla=False,
        target_spec=spec,
    )


def _shape(layout: KVLayout, engine: Mapping[str, Any], *, given: bool) -> dict[str, Any]:
    groups, per_rank = pool_shape(layout, engine)
    block = max(per_rank)
    rank = per_rank.index(block)
    full_groups = sum(1 for g in groups if g.kind == "full")
    bs = layout.block_size
    on_rank = [layer for layer in layout.layers if layer.pp_rank == rank]
    out: dict[str, Any] = {
        # one more token of context costs a block slot in every full-attention group
        "kv_bytes_per_token": full_groups * block // bs,
        "kv_bytes_per_token_source": "given" if given else "model config",
        "block_bytes": block,
        "kv_cache_groups": [
            {
                "kind": g.kind,
                "sliding_window": g.sliding_window,
                "layers": len(g.layers),
                "block_size": g.block_size,
            }
            for g in groups
        ],
        "layers_per_rank": len(on_rank),
    }
    if given:
        return out
    out.update(
        kv_bytes_per_token_model=sum(layer.unsharded_bytes_per_token for layer in layout.layers),
        page_size_bytes=layout.target_spec.page_size(bs),
        kv_heads_per_rank=layout.kv_heads_per_rank,
        head_dim=layout.head_dim,
        dtype_bytes=layout.dtype_bytes,
        kv_cache_dtype=layout.kv_cache_dtype,
        mla=layout.mla,
        drafter_layers_per_rank=sum(1 for layer in on_rank if layer.origin not in ("target",)),
        speculative=layout.speculative,
    )
    return out


def kv_bytes_per_token(
    model: Mapping[str, Any],
    engine: Mapping[str, Any] | None = None,
    *,
    draft_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """KV cache bytes per token on the binding GPU rank, and how they were counted.

    Args: see :func:`~.layers.kv_layout`.

    Returns:
        ``{"kv_bytes_per_token": bytes one more token of context costs on the binding
        rank (a block slot in every full-attention group), "kv_bytes_per_token_model":
        unsharded bytes per token (every KV layer, target and drafter, all KV heads, no
        window), "page_size_bytes": one target layer's page, "block_bytes": the pool's
        bytes per block on the binding rank, "kv_cache_groups": [{"kind", "sliding_window",
        "layers", "block_size"}], "layers_per_rank", "drafter_layers_per_rank",
        "kv_heads_per_rank", "head_dim", "dtype_bytes", "kv_cache_dtype", "mla",
        "speculative": {"method", "drafter_kv_layers", "source", ...} or None,
        "ignored_keys": [{"key", "source", "value", "reason"}], "notes": [str]}``.

    Raises:
        KVConfigError, KVCacheUnknown: see :func:`~.layers.kv_layout`.
    """
    engine = _norm(engine or {})
    layout = kv_layout(model, engine, draft_config=draft_config)
    out = _shape(layout, engine, given=False)
    out.update(ignored_keys=layout.ignored_keys, notes=list(layout.notes))
    return out


def available_kv_bytes(memory_gib: Mapping[str, Any], engine: Mapping[str, Any]) -> int:
    """KV cache memory on one GPU, in bytes.

    ``kv_cache_memory_bytes`` in ``engine`` wins (vLLM then skips the profile). Else
    ``memory_gib`` (GiB, per GPU) either gives ``available_kv_cache`` directly (as
    printed by vLLM V1 "Available KV cache memory") or the memory profile:
    ``total_gpu_memory``, ``peak_torch_memory`` (or ``weights_memory`` +
    ``peak_activation_memory``) and ``non_torch_memory``; then
    ``available = total * gpu_memory_utilization - peak_torch - non_torch``
    (``gpu_memory_utilization`` from ``engine``, default 0.9; ``vllm/v1/worker/gpu_worker.py``
    ``determine_available_memory``). Negative results clamp to 0.

    Raises :class:`KVConfigError` for a figure that is not a finite number >= 0, a key
    it does not know (a typo would drop a figure silently), a profile without the total
    or without any of the torch figures (taken as 0 it inflates the estimate), and a
    ``gpu_memory_utilization`` outside (0, 1].
    """
    if engine.get("kv_cache_memory_bytes") is not None:
        return engine_int(engine, "kv_cache_memory_bytes", 0, low=1)
    unknown = sorted(str(k) for k in memory_gib if k not in MEMORY_KEYS)
    if unknown:
        raise KVConfigError(
            ("memory_gib", unknown[0]), f"not a memory figure (known: {', '.join(MEMORY_KEYS)})"
        )
    figures = {k: _figure(k, v) for k, v in memory_gib.items() if v is not None}
    if "available_kv_cache" in figures:
        return max(0, int(figures["available_kv_cache"] * GIB))
    if "total_gpu_memory" not in figures:
        raise KVConfigError(
            ("memory_gib", "total_gpu_memory"),
            "give available_kv_cache, or the memory profile with total_gpu_memory",
        )
    if not {"peak_torch_memory", "weights_memory"} & set(figures):
        raise KVConfigError(
            ("memory_gib", "peak_torch_memory"),
            "give peak_torch_memory (or weights_memory and peak_activation_memory): "
            "taken as 0, the weights' memory would count as KV cache",
        )
    raw_util = engine.get("gpu_memory_utilization")
    util = 0.9 if raw_util is None else _figure("gpu_memory_utilization", raw_util, "engine")
    if not 0 < util <= 1:
        raise KVConfigError(("engine", "gpu_memory_utilization"), f"must be in (0, 1], got {util}")
    if "peak_torch_memory" in figures:
        torch_peak = figures["peak_torch_memory"]
    else:
        torch_peak = figures["weights_memory"] + figures.get("peak_activation_memory", 0.0)
    gib = figures["total_gpu_memory"] * util - torch_peak - figures.get("non_torch_memory", 0.0)
    return max(0, int(gib * GIB))


#: The figures ``memory_gib`` may hold (GiB per GPU, as vLLM's memory profile logs them).
MEMORY_KEYS = (
    "available_kv_cache",
    "total_gpu_memory",
    "peak_torch_memory",
    "weights_memory",
    "peak_activation_memory",
    "non_torch_memory",
)


def _figure(key: str, value: Any, where: str = "memory_gib") -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise KVConfigError((where, key), f"must be a finite number, got {value!r}")
    if value < 0:
        raise KVConfigError((where, key), f"must be >= 0, got {value!r}")
    return float(value)


def _norm(engine: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k).replace("-", "_"): v for k, v in engine.items()}


def _pool(
    model: Mapping[str, Any] | None,
    engine: Mapping[str, Any],
    memory_gib: Mapping[str, Any],
    draft_config: Mapping[str, Any] | None,
    given: int | None,
) -> tuple[Pool, dict[str, Any]]:
    engine = _norm(engine)
    available = available_kv_bytes(memory_gib, engine)
    if given is None:
        if model is None:
            raise KVConfigError(("model",), "give the model config or kv_bytes_per_token")
        layout = kv_layout(model, engine, draft_config=draft_config)
        shape = _shape(layout, engine, given=False)
        shape.update(ignored_keys=layout.ignored_keys, notes=list(layout.notes))
        return kv_pool(layout, engine, available), shape
    layout = _given_layout(given, engine)
    shape = _shape(layout, engine, given=True)
    notes = [f"kv_bytes_per_token {given} given: used as one full-attention layer per rank"]
    spec = engine.get("speculative_config")
    if spec:
        notes.append(
            "speculative_config is not added to a given kv_bytes_per_token: the figure "
            "must already hold the drafter's (draft model, EAGLE or MTP layers') KV cache"
        )
    # without the model, the engine keys are still checked: an unknown one is listed
    ignored = ignored_engine_keys(engine)
    if isinstance(spec, Mapping):
        ignored += ignored_spec_keys(spec)
    shape.update(ignored_keys=ignored, notes=notes)
    if model is not None:
        try:
            modelled = kv_bytes_per_token(model, engine, draft_config=draft_config)
            shape["kv_bytes_per_token_modelled"] = modelled["kv_bytes_per_token"]
            shape["ignored_keys"] = modelled["ignored_keys"]
        except (KVCacheUnknown, KVConfigError) as exc:
            shape["kv_bytes_per_token_modelled"] = None
            notes.append(f"the model config gives no figure: {exc}")
    return kv_pool(layout, engine, available), shape


def estimate_kv_cache(
    model: Mapping[str, Any] | None,
    engine: Mapping[str, Any],
    memory_gib: Mapping[str, Any],
    max_model_len: int,
    *,
    draft_config: Mapping[str, Any] | None = None,
    kv_bytes_per_token: int | None = None,
) -> dict[str, Any]:
    """Estimate what vLLM will print for the KV cache, and whether ``max_model_len`` fits.

    Args:
        model: the model's ``config.json`` (:func:`~.layers.kv_layout`); may be None
            when ``kv_bytes_per_token`` is given.
        engine: vLLM engine arguments: ``block_size`` (tokens, default 16),
            ``tensor_parallel_size``, ``pipeline_parallel_size``,
            ``gpu_memory_utilization``, ``kv_cache_dtype``, ``speculative_config``,
            ``max_num_batched_tokens`` and ``async_scheduling`` (sliding-window models),
            ``num_gpu_blocks_override``, ``kv_cache_memory_bytes``, ... (any vLLM
            argument; those not known are listed in ``ignored_keys``).
        memory_gib: per-GPU memory figures in GiB, see :func:`available_kv_bytes`.
        max_model_len: the context cap in tokens.
        draft_config: the drafter's ``config.json`` (EAGLE, draft model).
        kv_bytes_per_token: bytes per token per GPU to use instead of the model's
            (for models the estimator cannot model): one full-attention layer.

    Returns:
        JSON-safe dict: the fields of :func:`kv_bytes_per_token` plus ``block_size``,
        ``available_kv_bytes``, ``available_kv_gib``, ``gpu_blocks`` (per GPU),
        ``blocks_per_request``, ``kv_cache_needed_bytes`` (one ``max_model_len`` request:
        ``block_bytes * blocks_per_request``, vLLM's "X GiB KV cache is needed"),
        ``kv_cache_tokens`` (what vLLM prints: ``int(gpu_blocks /
        blocks_per_request * max_model_len)``), ``max_model_len``,
        ``maximum_concurrency`` (unrounded), ``fits`` (vLLM's start-up check, null block
        reserved), ``max_fitting_model_len`` (the largest ``max_model_len`` that fits,
        vLLM's "estimated maximum model length"; None when every layer slides),
        ``advice`` (:data:`FIT_ADVICE` when it does not fit), ``vllm_version_modelled``.

    Raises:
        KVConfigError, KVCacheUnknown: see :func:`~.layers.kv_layout`; ValueError for
        ``max_model_len < 1``.
    """
    if max_model_len < 1:
        raise ValueError("max_model_len must be >= 1")
    pool, shape = _pool(model, engine, memory_gib, draft_config, kv_bytes_per_token)
    available = available_kv_bytes(memory_gib, _norm(engine))
    fits = pool.fits(max_model_len)
    return {
        **shape,
        "notes": [*shape["notes"], *pool.notes],
        "block_size": pool.layout.block_size,
        "available_kv_bytes": available,
        "available_kv_gib": available / GIB,
        "gpu_blocks": pool.num_blocks,
        "blocks_per_request": pool.blocks_per_request(max_model_len),
        "kv_cache_needed_bytes": pool.bytes_per_block * pool.blocks_per_request(max_model_len),
        "kv_cache_tokens": pool.printed_tokens(max_model_len),
        "max_model_len": max_model_len,
        "maximum_concurrency": pool.concurrency(max_model_len),
        "fits": fits,
        "max_fitting_model_len": pool.largest(1, null_block=True),
        "advice": None if fits else FIT_ADVICE,
        "vllm_version_modelled": MODELLED_VLLM_VERSION,
    }


def max_fitting_context(
    model: Mapping[str, Any] | None,
    engine: Mapping[str, Any],
    memory_gib: Mapping[str, Any],
    concurrency: int = 1,
    *,
    draft_config: Mapping[str, Any] | None = None,
    kv_bytes_per_token: int | None = None,
) -> dict[str, Any]:
    """What context cap lets vLLM print a maximum concurrency of at least ``concurrency``.

    Returns ``{"kv_cache_tokens": the printed size at that cap, "concurrency": int,
    "max_model_len": the largest cap with concurrency * blocks_per_request <=
    gpu_blocks}`` (0 when not one token fits; None when every layer slides: the KV
    cache sets no cap). The printed concurrency counts every block; the scheduler keeps
    one (the null block) back.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    pool, _ = _pool(model, engine, memory_gib, draft_config, kv_bytes_per_token)
    length = pool.largest(concurrency, null_block=False)
    return {
        "kv_cache_tokens": pool.printed_tokens(length) if length else 0,
        "concurrency": concurrency,
        "max_model_len": length,
    }
