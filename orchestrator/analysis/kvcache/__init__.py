"""KV cache capacity estimator: bytes per token, blocks, tokens, concurrency, fit.

Pure functions: no database, no Ray, no HTTP. Units: bytes are ``int`` bytes,
``*_gib`` values are GiB (2**30 bytes), lengths are tokens. The formulas follow the
sources of vLLM 0.32.0 (:data:`MODELLED_VLLM_VERSION`, the CPU build in
``.engine-venv``; its GPU paths read the same files), cited with file and line in each
module:

- :mod:`.shapes`: one layer's KV cache per TP rank: ``page_size_bytes = block_size *
  num_kv_heads * (head_size + head_size_v) * dtype_bytes`` with ``num_kv_heads =
  max(1, total_kv_heads // TP)`` (KV heads replicated beyond TP = KV heads), MLA's one
  latent of ``kv_lora_rank + qk_rope_head_dim`` on every rank, ``fp8``/``fp8_e4m3``/
  ``fp8_e5m2`` 1 byte, ``auto`` the model dtype (16 bits for a float32 config), a
  checkpoint's KV quantization scheme; full or sliding-window layers
  (``layer_types``, ``sliding_window``).
- :mod:`.drafter`: speculative decoding from vLLM's own ``speculative_config``
  (``method``, ``model``, ``num_speculative_tokens``, ``draft_tensor_parallel_size``,
  ``kv_cache_dtype``; ``--spec-*``): MTP modules counted from the model config
  (``num_nextn_predict_layers``, ``mtp_num_hidden_layers``), EAGLE / EAGLE-3 heads and
  draft models from the drafter's config, ngram / suffix / Medusa / MLP speculators
  with no KV cache; drafter layers share the target's block pool.
- :mod:`.pool`: groups (hybrid sliding-window models), bytes per block, blocks
  ``available // bytes_per_block`` (smallest over PP ranks), blocks per request,
  ``Maximum concurrency = num_blocks / blocks_per_request``, the printed ``KV cache
  size = int(concurrency * max_model_len)``, and the start-up fit check (null block
  reserved).
- :mod:`.keys`: which config and engine keys are read, known irrelevant, unmodelled
  (the estimate is then *unknown*: :class:`KVCacheUnknown`), or unknown (listed in
  ``ignored_keys`` with the reason, never dropped silently).
- :mod:`.maxlen`: the model's maximum length and the ``max_model_len`` check as vLLM
  derives them (length keys, ``model_max_length``, RoPE scaling factor).
- :mod:`.estimate`: the public estimates; a ``kv_bytes_per_token`` given by the caller
  replaces the model (the answer says so).
- :mod:`.memory`: the memory figures an operator gives (what vLLM printed, or the
  profile: device memory, weights from the model's files, activation, non-torch) as the
  estimate takes them, every default taken written as an assumption.
- :mod:`.whatif`: what fits: the estimate at the cap, the cap for a concurrency and the
  table of caps (``POST /api/v1/analyze/kv-cache``).
- :mod:`.engine_check`: vLLM's printed figures (V0 and V1 wordings) and the per-run
  check of the estimate against them.

Available memory (memory profiling, ``vllm/v1/worker/gpu_worker.py``
``determine_available_memory``): ``total * gpu_memory_utilization - peak_torch -
non_torch``, or ``kv_cache_memory_bytes`` when set.
"""

from orchestrator.analysis.kvcache.engine_check import check_against_engine, parse_kv_cache_log
from orchestrator.analysis.kvcache.estimate import (
    FIT_ADVICE,
    GIB,
    MODELLED_VLLM_VERSION,
    available_kv_bytes,
    estimate_kv_cache,
    kv_bytes_per_token,
    max_fitting_context,
)
from orchestrator.analysis.kvcache.maxlen import derive_max_model_len
from orchestrator.analysis.kvcache.memory import MemoryProfile, memory_figures
from orchestrator.analysis.kvcache.shapes import (
    KV_CACHE_DTYPE_BYTES,
    KVCacheUnknown,
    KVConfigError,
    dtype_bytes,
    layers_per_pp_rank,
)
from orchestrator.analysis.kvcache.whatif import what_fits

#: Bytes per element of vLLM's plain ``--kv-cache-dtype`` choices.
DTYPE_BYTES = KV_CACHE_DTYPE_BYTES

__all__ = [
    "DTYPE_BYTES",
    "FIT_ADVICE",
    "GIB",
    "KVCacheUnknown",
    "KVConfigError",
    "MODELLED_VLLM_VERSION",
    "MemoryProfile",
    "available_kv_bytes",
    "check_against_engine",
    "derive_max_model_len",
    "dtype_bytes",
    "estimate_kv_cache",
    "kv_bytes_per_token",
    "layers_per_pp_rank",
    "max_fitting_context",
    "memory_figures",
    "parse_kv_cache_log",
    "what_fits",
]
