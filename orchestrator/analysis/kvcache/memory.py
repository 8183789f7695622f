"""The memory a KV cache estimate starts from, as an operator gives it: per device, in GiB.

Either what vLLM printed as "Available KV cache memory", the engine's
``kv_cache_memory_bytes``, or the memory profile: the device's memory with the weights
(default: the model's weight files divided over TP x PP), the peak activation memory
(default 0) and the non-torch memory (CUDA context, NCCL buffers; default 0).
:func:`memory_figures` turns that into the ``memory_gib`` figures of
:func:`~.estimate.available_kv_bytes`, with every default it took written as an
assumption; a refusal is a :class:`~.shapes.KVConfigError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.analysis.kvcache.estimate import GIB
from orchestrator.analysis.kvcache.shapes import KVConfigError

#: The files a model directory holds its weights in (their sizes are the weights' memory).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass(frozen=True)
class MemoryProfile:
    """Memory per device, in GiB (2**30 bytes): ``available_kv_cache_gib`` (what vLLM
    printed) or the profile (``device_memory_gib`` with ``weights_gib``,
    ``activation_gib``, ``non_torch_gib``)."""

    device_memory_gib: float | None = None
    weights_gib: float | None = None
    activation_gib: float = 0.0
    non_torch_gib: float = 0.0
    available_kv_cache_gib: float | None = None


def weights_gib(model_dir: Path | None, devices: int) -> float | None:
    """The model's weight files (:data:`WEIGHT_SUFFIXES`) over ``devices``, in GiB per
    device; None without a directory or weight files."""
    if model_dir is None:
        return None
    total = sum(f.stat().st_size for f in model_dir.iterdir() if f.name.endswith(WEIGHT_SUFFIXES))
    return total / GIB / devices if total else None


def memory_figures(
    memory: MemoryProfile,
    engine: Mapping[str, Any],
    model_dir: Path | None,
    devices: int,
    assumptions: list[str],
) -> dict[str, float]:
    """The per-device memory figures (GiB) the estimate uses.

    ``engine``'s ``kv_cache_memory_bytes`` wins, then ``available_kv_cache_gib``, then the
    profile; ``model_dir``: the model's directory, whose weight files give the weights'
    memory when ``weights_gib`` is not given (None for an inline config). Appends to
    ``assumptions`` each default taken (weights from the files, no activation memory).

    Raises:
        KVConfigError: both the printed figure and a profile given (``memory``), neither
            given (``memory``), or no weight size to be had (``memory.weights_gib``).
    """
    if memory.available_kv_cache_gib is not None and memory.device_memory_gib is not None:
        raise KVConfigError(
            ("memory",),
            "give either available_kv_cache_gib (what vLLM printed) or the memory profile "
            "(device_memory_gib, weights_gib, ...), not both",
        )
    if engine.get("kv_cache_memory_bytes") is not None:
        return {"available_kv_cache": engine["kv_cache_memory_bytes"] / GIB}
    if memory.available_kv_cache_gib is not None:
        return {"available_kv_cache": memory.available_kv_cache_gib}
    if memory.device_memory_gib is None:
        raise KVConfigError(
            ("memory",),
            "give device_memory_gib (per device), available_kv_cache_gib or "
            "engine.kv_cache_memory_bytes",
        )
    weights = memory.weights_gib
    if weights is None:
        weights = weights_gib(model_dir, devices)
        if weights is None:
            where = (
                "the model directory has no weight files to size"
                if model_dir is not None
                else "an inline model config has no weight files to size"
            )
            raise KVConfigError(
                ("memory", "weights_gib"),
                f"{where}; give weights_gib (per device, GiB: the 'Loading weights took … GiB' "
                "figure)",
            )
        assumptions.append(
            f"weights: the model's weight files over {devices} device(s) = {weights:.2f} GiB"
        )
    if memory.activation_gib == 0:
        assumptions.append(
            "peak activation memory 0 GiB: give activation_gib from a profiled start "
            "for a tighter figure"
        )
    return {
        "total_gpu_memory": memory.device_memory_gib,
        "weights_memory": weights,
        "peak_activation_memory": memory.activation_gib,
        "non_torch_memory": memory.non_torch_gib,
    }


def no_memory_left(memory: MemoryProfile, engine: Mapping[str, Any]) -> str:
    """The assumption to write when a profile leaves nothing for the KV cache."""
    return (
        "no memory is left for the KV cache: weights + activation + non-torch memory "
        f"exceed device_memory_gib x gpu_memory_utilization "
        f"({memory.device_memory_gib} x {engine.get('gpu_memory_utilization')}); use more "
        "devices (TP/PP split the weights) or a smaller model"
    )
