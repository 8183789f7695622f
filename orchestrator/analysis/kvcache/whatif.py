"""What fits: the KV cache of one configuration on given devices, as ``POST
/api/v1/analyze/kv-cache`` answers it (the route resolves the model and maps refusals to
422s; this is the answer).

The context cap checked is ``engine.max_model_len`` or the model's maximum
(:func:`~.maxlen.derive_max_model_len`); the estimate at that cap
(:func:`~.estimate.estimate_kv_cache`), the largest cap at which ``concurrency``
full-length requests fit (:func:`~.estimate.max_fitting_context`), and the table of caps
for powers of two from 512 (or the block size) up to the model's maximum.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.analysis.kvcache.estimate import estimate_kv_cache, max_fitting_context
from orchestrator.analysis.kvcache.maxlen import derive_max_model_len
from orchestrator.analysis.kvcache.memory import MemoryProfile, memory_figures, no_memory_left

#: The smallest cap of the table of caps (tokens; a larger block size raises it).
FIRST_CAP = 512


def what_fits(
    config: Mapping[str, Any] | None,
    engine: Mapping[str, Any],
    memory: MemoryProfile,
    *,
    model_dir: Path | None = None,
    draft_config: Mapping[str, Any] | None = None,
    kv_bytes_per_token: int | None = None,
    concurrency: int | None = None,
) -> dict[str, Any]:
    """The KV cache answer for ``config`` (the model's ``config.json``, None with
    ``kv_bytes_per_token``) launched with ``engine`` (vLLM arguments, with
    ``tensor_parallel_size``, ``pipeline_parallel_size``, ``block_size`` and
    ``gpu_memory_utilization``) on devices with ``memory``.

    Returns ``{"estimate": estimate_kv_cache(...) per device (bytes, tokens), "devices":
    TP x PP, "memory_gib": the per-device figures used (:func:`~.memory.memory_figures`),
    "kv_bytes_per_token_source": "model config" or "given", "ignored_keys": [{"key",
    "source", "value", "reason"}], "assumptions": [str], "max_model_len_for_concurrency":
    max_fitting_context(...) only when ``concurrency`` is given, "context_caps":
    [{"max_model_len", "maximum_concurrency" (2 decimals), "fits"}]}``.

    Raises:
        KVConfigError, KVCacheUnknown: from the memory figures and the estimator, naming
            the field; TypeError, ValueError, KeyError for a value of a shape no rule
            expected.
    """
    devices = int(engine.get("tensor_parallel_size") or 1) * int(
        engine.get("pipeline_parallel_size") or 1
    )
    assumptions: list[str] = []
    figures = memory_figures(memory, engine, model_dir, devices, assumptions)
    lengths = derive_max_model_len(config, engine)
    cap = lengths["max_model_len"]
    assumptions.extend(lengths["notes"])
    extra: dict[str, Any] = {"draft_config": draft_config, "kv_bytes_per_token": kv_bytes_per_token}
    est = estimate_kv_cache(config, engine, figures, cap, **extra)
    assumptions.extend(est["notes"])
    if est["gpu_blocks"] == 0 and "available_kv_cache" not in figures:
        assumptions.append(no_memory_left(memory, engine))
    est["available_kv_gib"] = round(est["available_kv_gib"], 4)
    out: dict[str, Any] = {
        "estimate": est,
        "devices": devices,
        "memory_gib": dict(figures),
        "kv_bytes_per_token_source": est["kv_bytes_per_token_source"],
        "ignored_keys": est["ignored_keys"],
        "assumptions": assumptions,
    }
    if concurrency:
        out["max_model_len_for_concurrency"] = max_fitting_context(
            config, engine, figures, concurrency, **extra
        )
    derived = lengths["derived_max_model_len"]
    top = int(derived) if derived is not None else cap
    block_size = int(engine.get("block_size") or 16)
    length = 2 ** max(int(math.log2(FIRST_CAP)), int(math.log2(max(1, block_size))))
    caps = []
    while length <= top:
        row = estimate_kv_cache(config, engine, figures, length, **extra)
        caps.append(
            {
                "max_model_len": length,
                "maximum_concurrency": round(row["maximum_concurrency"], 2),
                "fits": row["fits"],
            }
        )
        length *= 2
    out["context_caps"] = caps
    return out
