"""The KV cache estimator against vLLM 0.32.0's own sizing code.

``data/kvcache/vllm_probe.py`` runs in the engine venv: it builds vLLM's
``FullAttentionSpec`` / ``SlidingWindowSpec`` / ``MLAAttentionSpec`` layers written out by hand
below and calls ``get_kv_cache_configs`` and ``get_kv_cache_capacity``
(``vllm/v1/core/kv_cache_utils.py`` L2531, L2300): the functions behind "GPU KV cache size:
N tokens, Maximum concurrency for L tokens per request: Cx" and "the estimated maximum model
length is N". The estimator gets the model configs and must find the same numbers.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from orchestrator.analysis.kvcache import estimate_kv_cache
from tests.conftest import ENGINE_PYTHON, needs_engine
from tests.orchestrator.analysis.test_kvcache import DEEPSEEK_R1, GPT_OSS_20B, LLAMA, SW_ENGINE

_PROBE = Path(__file__).parent / "data" / "kvcache" / "vllm_probe.py"


def _layers(
    count: int, kind: str, heads: int, head: int, dtype: str = "bf16", window: int | None = None
) -> dict[str, Any]:
    return {
        "count": count,
        "kind": kind,
        "heads": heads,
        "head": head,
        "dtype": dtype,
        "window": window,
    }


def _cases() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(vLLM probe case: layer specs written out by hand, estimator call)."""
    alt = [_layers(1, k, 8, 64, window=128) for k in ("sliding", "full")] * 12
    gemma = [
        _layers(1, "full" if (i + 1) % 6 == 0 else "sliding", 16, 128, window=1024)
        for i in range(62)
    ]
    qwen3 = {
        "model_type": "qwen3",
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
    }
    gemma3 = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "sliding_window": 1024,
    }
    head = {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
    }
    l1b = {
        "model_type": "llama",
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
    }
    eagle = {"method": "eagle3", "model": "x", "num_speculative_tokens": 3}
    draft = {
        "method": "draft_model",
        "model": "x",
        "num_speculative_tokens": 4,
        "draft_tensor_parallel_size": 1,
    }
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    gib = 2**30
    return [
        (
            {"L": 4096, "avail": int(69.66 * gib), "workers": [[_layers(28, "full", 8, 128)]]},
            {"model": qwen3, "engine": {}, "L": 4096, "gib": 69.66},
        ),
        (
            {"L": 29000, "avail": int(3.81 * gib), "workers": [[_layers(32, "full", 8, 128)]]},
            {"model": LLAMA, "engine": {}, "L": 29000, "gib": 3.81},
        ),
        (  # vllm-project/vllm#10517 at 29,000 tokens: does not fit
            {"L": 29000, "avail": int(2.89 * gib), "workers": [[_layers(32, "full", 8, 128)]]},
            {"model": LLAMA, "engine": {}, "L": 29000, "gib": 2.89},
        ),
        (
            {
                "L": 100000,
                "avail": int(10.55 * gib),
                "workers": [[_layers(48, "full", 4, 128, dtype="fp8")]],
            },
            {
                "model": {**qwen3, "num_hidden_layers": 48, "num_key_value_heads": 4},
                "engine": {"kv_cache_dtype": "fp8"},
                "L": 100000,
                "gib": 10.55,
            },
        ),
        (
            {"L": 32768, "avail": 4 * gib, "in_flight": 16384, "mnbt": 8192, "workers": [alt]},
            {"model": GPT_OSS_20B, "engine": SW_ENGINE, "L": 32768, "gib": 4.0},
        ),
        (
            {
                "L": 32768,
                "avail": 4 * gib,
                "in_flight": 16384,
                "mnbt": 8192,
                "workers": [alt + [_layers(1, "full", 8, 64)]],
            },
            {
                "model": GPT_OSS_20B,
                "engine": {**SW_ENGINE, "speculative_config": eagle},
                "L": 32768,
                "gib": 4.0,
                "draft": head,
            },
        ),
        (
            {"L": 8192, "avail": 8 * gib, "in_flight": 8192, "mnbt": 8192, "workers": [gemma]},
            {
                "model": gemma3,
                "engine": {"max_num_batched_tokens": 8192, "async_scheduling": False},
                "L": 8192,
                "gib": 8.0,
            },
        ),
        (
            {"L": 32768, "avail": 4 * gib, "disable_hma": True, "workers": [alt]},
            {
                "model": GPT_OSS_20B,
                "engine": {**SW_ENGINE, "disable_hybrid_kv_cache_manager": True},
                "L": 32768,
                "gib": 4.0,
            },
        ),
        (
            {
                "L": 65536,
                "avail": 30 * gib,
                "workers": [
                    [
                        {
                            "count": 62,
                            "kind": "mla",
                            "heads": 1,
                            "head": 576,
                            "dtype": "fp8",
                            "cache": "fp8",
                        }
                    ]
                ],
            },
            {
                "model": DEEPSEEK_R1,
                "engine": {
                    "kv_cache_dtype": "fp8",
                    "tensor_parallel_size": 8,
                    "speculative_config": mtp,
                },
                "L": 65536,
                "gib": 30.0,
            },
        ),
        (
            {
                "L": 32768,
                "avail": 20 * gib,
                "workers": [[_layers(80, "full", 2, 128), _layers(16, "full", 8, 64)]],
            },
            {
                "model": {
                    **LLAMA,
                    "num_hidden_layers": 80,
                    "num_attention_heads": 64,
                    "head_dim": 128,
                },
                "engine": {"tensor_parallel_size": 4, "speculative_config": draft},
                "L": 32768,
                "gib": 20.0,
                "draft": l1b,
            },
        ),
        (
            {
                "L": 16384,
                "avail": 2 * gib,
                "workers": [
                    [_layers(7, "full", 8, 128)],
                    [_layers(8, "full", 8, 128)],
                    [_layers(8, "full", 8, 128)],
                    [_layers(7, "full", 8, 128)],
                ],
            },
            {
                "model": {**LLAMA, "num_hidden_layers": 30},
                "engine": {"pipeline_parallel_size": 4},
                "L": 16384,
                "gib": 2.0,
            },
        ),
    ]


@pytest.mark.engine
@needs_engine
def test_matches_vllm_own_sizing() -> None:
    """vLLM 0.32.0's ``get_kv_cache_configs`` / ``get_kv_cache_capacity`` (the functions
    behind "GPU KV cache size: N tokens, Maximum concurrency for L tokens per request: Cx")
    run on hand-written layer specs; the estimator, given the model configs, must find the
    same blocks, printed tokens, concurrency and fit for GQA, fp8, hybrid sliding windows
    (with an EAGLE head and with the hybrid manager off), MLA + MTP, a draft model of
    another shape and uneven PP."""
    cases = _cases()
    probe = [{"block_size": 16, **c} for c, _ in cases]
    out = subprocess.run(
        [str(ENGINE_PYTHON), str(_PROBE)],
        input=json.dumps(probe),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for (_, call), vllm in zip(cases, got, strict=True):
        est = estimate_kv_cache(
            call["model"],
            call["engine"],
            {"available_kv_cache": call["gib"]},
            call["L"],
            draft_config=call.get("draft"),
        )
        assert est["fits"] is vllm["fits"], (call, vllm)
        if not vllm["fits"]:
            assert est["max_fitting_model_len"] == vllm["estimated_max_len"]
            continue
        assert est["gpu_blocks"] == vllm["num_blocks"], (call, vllm)
        assert est["kv_cache_tokens"] == vllm["tokens"], (call, vllm)
        assert est["maximum_concurrency"] == pytest.approx(vllm["concurrency"], rel=1e-12)
        assert len(est["kv_cache_groups"]) == vllm["groups"]
        assert est["kv_cache_needed_bytes"] == vllm["needed_bytes"]
