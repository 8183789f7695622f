"""The memory figures of a KV cache what-if (:mod:`orchestrator.analysis.kvcache.memory`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.analysis.kvcache import GIB, KVConfigError, MemoryProfile, memory_figures


def test_the_weights_are_the_model_files_over_the_devices(tmp_path: Path) -> None:
    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 3000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "tokenizer.json").write_bytes(b"\0" * 5000)  # not weights
    notes: list[str] = []
    figures = memory_figures(MemoryProfile(device_memory_gib=80), {}, tmp_path, 2, notes)
    assert figures == {
        "total_gpu_memory": 80,
        "weights_memory": 4000 / GIB / 2,
        "peak_activation_memory": 0.0,
        "non_torch_memory": 0.0,
    }
    assert notes[0].startswith("weights: the model's weight files over 2 device(s)")
    assert notes[1].startswith("peak activation memory 0 GiB")


def test_a_printed_figure_or_the_engine_bytes_win_over_a_profile() -> None:
    notes: list[str] = []
    printed = MemoryProfile(available_kv_cache_gib=12.5)
    assert memory_figures(printed, {}, None, 1, notes) == {"available_kv_cache": 12.5}
    engine = {"kv_cache_memory_bytes": 2 * GIB}
    given = MemoryProfile(device_memory_gib=80, weights_gib=10)
    assert memory_figures(given, engine, None, 1, notes) == {"available_kv_cache": 2.0}
    assert notes == []


@pytest.mark.parametrize(
    ("memory", "loc", "words"),
    [
        (MemoryProfile(device_memory_gib=80, available_kv_cache_gib=10), ("memory",), "not both"),
        (MemoryProfile(), ("memory",), "give device_memory_gib"),
        (MemoryProfile(device_memory_gib=80), ("memory", "weights_gib"), "inline model config"),
    ],
)
def test_refusals_name_the_field(memory: MemoryProfile, loc: tuple[str, ...], words: str) -> None:
    with pytest.raises(KVConfigError) as err:
        memory_figures(memory, {}, None, 1, [])
    assert err.value.loc == loc and words in err.value.msg
