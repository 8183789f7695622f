"""KV cache capacity estimator: bytes per token, blocks, tokens, concurrency, fit.

Pure functions: no database, no Ray, no HTTP. Units: bytes are ``int`` bytes,
``*_gib`` values are GiB (2**30 bytes), lengths are tokens.

Formulas follow vLLM's sources:

- **Page size** (``vllm/v1/kv_cache_interface.py``, ``AttentionSpec.page_size_bytes``)::

      page_size_bytes = 2 * block_size * num_kv_heads * head_size * dtype_bytes

  per layer (2 = K and V). MLA layers (``MLAAttentionSpec``) store one latent
  per token: ``block_size * 1 * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes``.
  Bytes per token on one GPU = ``page_size_bytes / block_size * layers_on_rank``.
- **Heads per rank** (``vllm/config.py``, ``ModelConfig.get_num_kv_heads``)::

      num_kv_heads = max(1, total_num_kv_heads // tensor_parallel_size)

  so KV heads are *replicated* when TP > KV heads. MLA's latent is replicated on
  every TP rank (not divided).
- **Layers per rank** (``vllm/distributed/utils.py``, ``get_pp_indices``): the
  ``L // PP`` split with the remainder ``L % PP`` given one each to the ranks
  before the last; the rank with the most layers binds (vLLM gives every rank the
  smallest block count, ``kv_cache_utils.py``: ``get_kv_cache_configs``). Extra
  draft / MTP layers (``extra_kv_layers``) sit on the last PP rank.
- **Available memory** (memory profiling; V0 ``vllm/worker/worker.py``
  ``determine_num_available_blocks``, V1 ``vllm/v1/worker/gpu_worker.py``
  ``determine_available_memory``)::

      available = total_gpu_memory * gpu_memory_utilization
                  - peak_torch_memory - non_torch_memory

  where ``peak_torch_memory`` = weights + peak activation when given separately.
- **Blocks** (``vllm/v1/core/kv_cache_utils.py``, ``get_num_blocks``; V0
  ``CacheEngine.get_cache_block_size``)::

      num_blocks = available // page_size_bytes // num_layers

  KV cache size in tokens = ``num_blocks * block_size``.
- **Maximum concurrency** (``kv_cache_utils.py``,
  ``get_max_concurrency_for_kv_cache_config``)::

      num_blocks / cdiv(max_model_len, block_size)

  and ``max_model_len`` fits iff ``cdiv(max_model_len, block_size) <= num_blocks``
  (``check_enough_kv_cache_memory``), i.e. ``max_model_len <= kv_cache_tokens``.

Also :func:`parse_kv_cache_log` reads the figures vLLM prints (V0 and V1 wordings,
any line prefix, thousands separators) so estimate and engine can be compared.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

GIB = 2**30

__all__ = [
    "DTYPE_BYTES",
    "GIB",
    "FIT_ADVICE",
    "available_kv_bytes",
    "dtype_bytes",
    "estimate_kv_cache",
    "kv_bytes_per_token",
    "layers_per_pp_rank",
    "max_fitting_context",
    "parse_kv_cache_log",
]

#: Bytes per element of a KV cache dtype (vLLM ``--kv-cache-dtype`` names and torch names).
DTYPE_BYTES: dict[str, int] = {
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp32": 4,
    "float32": 4,
    "float": 4,
}

FIT_ADVICE = (
    "lower max_model_len to at most the KV cache token capacity, or raise "
    "gpu_memory_utilization, or add GPUs (TP divides KV heads per rank)"
)


def dtype_bytes(dtype: str | None, model_dtype: str | None = None) -> int:
    """Bytes per element of ``dtype``; ``"auto"``/``None`` uses ``model_dtype`` (default bf16).

    Raises:
        ValueError: unknown dtype name.
    """
    name = (dtype or "auto").lower().removeprefix("torch.")
    if name == "auto":
        name = (model_dtype or "bfloat16").lower().removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def layers_per_pp_rank(num_layers: int, pp: int) -> list[int]:
    """Layers on each PP rank, as vLLM's ``get_pp_indices`` splits them.

    ``L // PP`` each; the ``L % PP`` leftover layers go one each to the ranks just
    before the last (``partitions[-i] += 1`` for ``i in 2..remaining+1``).
    """
    if pp < 1 or num_layers < pp:
        raise ValueError(f"cannot split {num_layers} layers over PP={pp}")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


def _engine_int(engine: Mapping[str, Any], key: str, default: int) -> int:
    value = engine.get(key)
    return default if value is None else int(value)


def kv_bytes_per_token(model: Mapping[str, Any], engine: Mapping[str, Any] | None = None) -> dict:
    """KV cache bytes per token, for the whole model and for the binding GPU rank.

    Args:
        model: HF-config-like dict: ``num_hidden_layers``, ``num_key_value_heads``
            (else ``num_attention_heads``: MHA), ``head_dim`` (else
            ``hidden_size // num_attention_heads``), optional ``kv_cache_dtype`` /
            ``torch_dtype``, ``extra_kv_layers`` (draft / MTP layers that hold a KV
            cache; aliases ``num_draft_layers``, ``num_mtp_layers``), MLA fields
            ``kv_lora_rank`` + ``qk_rope_head_dim`` (used when ``use_mla`` is true or
            ``kv_lora_rank`` is set).
        engine: ``tensor_parallel_size``, ``pipeline_parallel_size``,
            ``kv_cache_dtype`` (overrides the model's), ``block_size`` (default 16).

    Returns:
        ``{"kv_bytes_per_token": per-GPU bytes/token on the binding rank,
        "kv_bytes_per_token_model": unsharded bytes/token (all layers, all KV heads),
        "page_size_bytes": per layer per block on one GPU, "block_bytes": one block
        over the rank's layers, "kv_heads_per_rank", "layers_per_rank" (binding),
        "head_dim", "dtype_bytes", "mla"}``.
    """
    engine = engine or {}
    tp = _engine_int(engine, "tensor_parallel_size", 1)
    pp = _engine_int(engine, "pipeline_parallel_size", 1)
    block_size = _engine_int(engine, "block_size", 16)
    nbytes = dtype_bytes(
        engine.get("kv_cache_dtype") or model.get("kv_cache_dtype"),
        model.get("torch_dtype") or model.get("dtype"),
    )
    layers = int(model["num_hidden_layers"])
    extra = int(
        model.get("extra_kv_layers")
        or model.get("num_draft_layers")
        or model.get("num_mtp_layers")
        or 0
    )
    mla = bool(model.get("use_mla", model.get("kv_lora_rank") is not None))
    if mla:
        head_dim = int(model["kv_lora_rank"]) + int(model.get("qk_rope_head_dim", 0))
        total_heads, heads_rank, kv_factor = 1, 1, 1
    else:
        heads = model.get("num_attention_heads")
        head_dim = int(model.get("head_dim") or int(model["hidden_size"]) // int(heads or 1))
        total_heads = int(model.get("num_key_value_heads") or heads or 1)
        heads_rank = max(1, total_heads // tp)
        kv_factor = 2
    parts = layers_per_pp_rank(layers, pp)
    parts[-1] += extra
    rank_layers = max(parts)
    page = kv_factor * block_size * heads_rank * head_dim * nbytes
    return {
        "kv_bytes_per_token": page // block_size * rank_layers,
        "kv_bytes_per_token_model": kv_factor * (layers + extra) * total_heads * head_dim * nbytes,
        "page_size_bytes": page,
        "block_bytes": page * rank_layers,
        "kv_heads_per_rank": heads_rank,
        "layers_per_rank": rank_layers,
        "head_dim": head_dim,
        "dtype_bytes": nbytes,
        "mla": mla,
    }


def available_kv_bytes(memory_gib: Mapping[str, Any], engine: Mapping[str, Any]) -> int:
    """KV cache memory on one GPU, in bytes.

    ``memory_gib`` (GiB, per GPU) either gives ``available_kv_cache`` directly (as
    printed by vLLM V1 "Available KV cache memory") or the memory profile:
    ``total_gpu_memory``, ``peak_torch_memory`` (or ``weights_memory`` +
    ``peak_activation_memory``) and ``non_torch_memory``; then
    ``available = total * gpu_memory_utilization - peak_torch - non_torch``
    (``gpu_memory_utilization`` from ``engine``, default 0.9; vLLM memory profiling).
    Negative results clamp to 0.
    """
    if memory_gib.get("available_kv_cache") is not None:
        return max(0, int(float(memory_gib["available_kv_cache"]) * GIB))
    util = float(engine.get("gpu_memory_utilization") or 0.9)
    if memory_gib.get("peak_torch_memory") is not None:
        torch_peak = float(memory_gib["peak_torch_memory"])
    else:
        torch_peak = float(memory_gib.get("weights_memory", 0.0)) + float(
            memory_gib.get("peak_activation_memory", 0.0)
        )
    total = float(memory_gib["total_gpu_memory"])
    gib = total * util - torch_peak - float(memory_gib.get("non_torch_memory", 0.0))
    return max(0, int(gib * GIB))


def estimate_kv_cache(
    model: dict[str, Any],
    engine: dict[str, Any],
    memory_gib: dict[str, Any],
    max_model_len: int,
) -> dict[str, Any]:
    """Estimate what vLLM will print for the KV cache, and whether ``max_model_len`` fits.

    Args:
        model: see :func:`kv_bytes_per_token`.
        engine: ``block_size`` (tokens, default 16), ``tensor_parallel_size``,
            ``pipeline_parallel_size``, ``gpu_memory_utilization``, ``kv_cache_dtype``.
        memory_gib: per-GPU memory figures in GiB, see :func:`available_kv_bytes`.
        max_model_len: the context cap in tokens.

    Returns:
        JSON-safe dict: ``kv_bytes_per_token`` (bytes, binding GPU),
        ``kv_bytes_per_token_model`` (bytes, unsharded), ``page_size_bytes``,
        ``block_bytes``, ``kv_heads_per_rank``, ``layers_per_rank``, ``head_dim``,
        ``dtype_bytes``, ``block_size`` (tokens), ``available_kv_bytes``,
        ``available_kv_gib``, ``gpu_blocks`` (per GPU), ``kv_cache_tokens``,
        ``max_model_len``, ``maximum_concurrency`` (``gpu_blocks /
        cdiv(max_model_len, block_size)``, unrounded), ``fits`` (bool),
        ``max_fitting_model_len`` (tokens = ``kv_cache_tokens``) and ``advice``
        (:data:`FIT_ADVICE` when it does not fit, else ``None``).
        Formulas and sources: module docstring.
    """
    if max_model_len < 1:
        raise ValueError("max_model_len must be >= 1")
    shape = kv_bytes_per_token(model, engine)
    block_size = _engine_int(engine, "block_size", 16)
    available = available_kv_bytes(memory_gib, engine)
    blocks = available // shape["page_size_bytes"] // shape["layers_per_rank"]
    tokens = blocks * block_size
    blocks_per_request = math.ceil(max_model_len / block_size)
    fits = blocks_per_request <= blocks
    return {
        **shape,
        "block_size": block_size,
        "available_kv_bytes": available,
        "available_kv_gib": available / GIB,
        "gpu_blocks": blocks,
        "kv_cache_tokens": tokens,
        "max_model_len": max_model_len,
        "maximum_concurrency": blocks / blocks_per_request,
        "fits": fits,
        "max_fitting_model_len": tokens,
        "advice": None if fits else FIT_ADVICE,
    }


def max_fitting_context(
    model: dict[str, Any],
    engine: dict[str, Any],
    memory_gib: dict[str, Any],
    concurrency: int = 1,
) -> dict[str, Any]:
    """What context cap fits so that ``concurrency`` full-length requests fit at once.

    Returns ``{"kv_cache_tokens": int, "concurrency": int, "max_model_len": int}``
    where ``max_model_len = (gpu_blocks // concurrency) * block_size`` tokens (0 when
    not even one block per request fits). With ``concurrency=1`` this is vLLM's
    own largest admissible ``max_model_len`` (``check_enough_kv_cache_memory``).
    Use :func:`estimate_kv_cache` for the concurrency at a given cap.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    est = estimate_kv_cache(model, engine, memory_gib, max_model_len=1)
    return {
        "kv_cache_tokens": est["kv_cache_tokens"],
        "concurrency": concurrency,
        "max_model_len": est["gpu_blocks"] // concurrency * est["block_size"],
    }


# --------------------------------------------------------------------------- log lines

_NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"
_UNIT = {"gib": 1.0, "gb": 1e9 / GIB, "mib": 1 / 1024, "mb": 1e6 / GIB}
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # V1: "Available KV cache memory: 6.51 GiB"
    (
        "available_kv_cache_gib",
        re.compile(rf"Available KV cache memory:\s*{_NUM}\s*(GiB|GB|MiB|MB)"),
    ),
    # V0: "... the rest of the memory reserved for KV Cache is 3.81GiB."
    (
        "available_kv_cache_gib",
        re.compile(rf"reserved for KV Cache is\s*{_NUM}\s*(GiB|GB|MiB|MB)", re.IGNORECASE),
    ),
    # V1: "GPU KV cache size: 42,656 tokens"
    ("kv_cache_tokens", re.compile(rf"KV cache size:\s*{_NUM}\s*tokens")),
    # V0: "# GPU blocks: 1952, # CPU blocks: 2048" (older: "# cuda blocks: 1952")
    ("gpu_blocks", re.compile(rf"#\s*(?:GPU|cuda|gpu)\s+blocks:\s*{_NUM}")),
)
_CONCURRENCY = re.compile(
    rf"Maximum concurrency for\s*{_NUM}\s*tokens per request:\s*{_NUM}\s*x", re.IGNORECASE
)


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def parse_kv_cache_log(lines: Iterable[str]) -> dict[str, Any]:
    """Pick vLLM's KV cache figures out of engine log lines (last occurrence wins).

    Understands V1 (``Available KV cache memory: X GiB``, ``GPU KV cache size: N
    tokens``) and V0 (``reserved for KV Cache is XGiB``, ``# GPU blocks: N``)
    wordings and ``Maximum concurrency for N tokens per request: X.XXx`` from both;
    any line prefix (timestamps, ``(VllmWorker rank=0 pid=1)``, container names)
    and thousands separators. Returns only the keys found, among
    ``available_kv_cache_gib`` (GiB), ``kv_cache_tokens``, ``gpu_blocks``,
    ``max_concurrency_tokens_per_request`` (tokens) and ``maximum_concurrency``.
    """
    out: dict[str, Any] = {}
    for line in lines:
        for key, pattern in _PATTERNS:
            m = pattern.search(line)
            if not m:
                continue
            if key == "available_kv_cache_gib":
                out[key] = _num(m.group(1)) * _UNIT[m.group(2).lower()]
            else:
                out[key] = int(_num(m.group(1)))
        m = _CONCURRENCY.search(line)
        if m:
            out["max_concurrency_tokens_per_request"] = int(_num(m.group(1)))
            out["maximum_concurrency"] = _num(m.group(2))
    return out


# --------------------------------------------------------------------------- run check


def _printed_tolerance_tokens(gib: float, bytes_per_token: int, block_size: int) -> int:
    """Tokens the estimate may differ by because vLLM prints GiB with two decimals.

    ±0.005 GiB of memory, as tokens, rounded up to a whole block; at least one block.
    """
    tokens = math.ceil(0.005 * GIB / max(1, bytes_per_token))
    return max(block_size, math.ceil(tokens / block_size) * block_size)


def check_against_engine(
    model_config: Mapping[str, Any],
    engine_args: Mapping[str, Any],
    startup_facts: Mapping[str, Any],
) -> dict[str, Any] | None:
    """The estimate for a run, next to what its engine printed at start-up.

    Args:
        model_config: the model's ``config.json`` (HF names; see :func:`kv_bytes_per_token`).
        engine_args: the run's resolved engine arguments (``block_size``,
            ``kv_cache_dtype``, ``tensor_parallel_size``, ``pipeline_parallel_size``,
            ``max_model_len``).
        startup_facts: parsed engine start-up lines (``jobs.enginelog``):
            ``available_kv_cache_memory_gib``, ``kv_cache_size_tokens``,
            ``max_concurrency``, ``max_concurrency_context_tokens``, ``max_model_len``.

    Returns:
        ``None`` when the engine printed no KV cache memory figure. Otherwise
        ``{"estimate": estimate_kv_cache(...) with the engine's own available
        memory, "engine": {"kv_cache_tokens", "maximum_concurrency",
        "available_kv_cache_gib"}, "tolerance_tokens": int, "difference_tokens":
        engine - estimate, "agrees": bool}``. The tolerance is the rounding of
        the printed GiB figure (two decimals) in whole blocks: a bigger gap means
        the bytes-per-token model is wrong for this engine (e.g. an attention
        backend with another layout, or a per-rank figure reported for all ranks).
    """
    gib = startup_facts.get("available_kv_cache_memory_gib")
    if gib is None:
        return None
    block_size = int(engine_args.get("block_size") or 16)
    max_model_len = int(
        startup_facts.get("max_concurrency_context_tokens")
        or engine_args.get("max_model_len")
        or startup_facts.get("max_model_len")
        or block_size
    )
    engine = {
        "block_size": block_size,
        "kv_cache_dtype": engine_args.get("kv_cache_dtype"),
        "tensor_parallel_size": engine_args.get("tensor_parallel_size") or 1,
        "pipeline_parallel_size": engine_args.get("pipeline_parallel_size") or 1,
    }
    est = estimate_kv_cache(
        dict(model_config), engine, {"available_kv_cache": float(gib)}, max_model_len
    )
    printed_tokens = startup_facts.get("kv_cache_size_tokens")
    tolerance = _printed_tolerance_tokens(float(gib), est["kv_bytes_per_token"], block_size)
    diff = None if printed_tokens is None else int(printed_tokens) - int(est["kv_cache_tokens"])
    return {
        "estimate": est,
        "engine": {
            "kv_cache_tokens": printed_tokens,
            "maximum_concurrency": startup_facts.get("max_concurrency"),
            "available_kv_cache_gib": float(gib),
        },
        "tolerance_tokens": tolerance,
        "difference_tokens": diff,
        "agrees": diff is not None and abs(diff) <= tolerance,
    }
