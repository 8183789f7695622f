"""``POST /api/v1/analyze/kv-cache``: the model's maximum length as vLLM 0.32.0 derives it
(``vllm/transformers_utils/model_arch_config_convertor.py`` L394-L427,
``vllm/config/model.py`` L2527-L2667; :mod:`orchestrator.analysis.kvcache.maxlen`), and the
layouts vLLM decides by model code (issue #16 trial)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from orchestrator.analysis.kvcache import KVCacheUnknown, KVConfigError, derive_max_model_len

LLAMA = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
}
MEM = {"available_kv_cache_gib": 20.0}


def _post(client: TestClient, model: dict[str, Any], **engine: Any) -> Any:
    return client.post(
        "/api/v1/analyze/kv-cache", json={"model": model, "engine": engine, "memory": MEM}
    )


def test_smallest_length_key_is_the_default_cap(client: TestClient) -> None:
    """convertor L415-L420: "Choose the smallest max_length from the possible keys"
    (ChatGLM2's seq_length beside max_position_embeddings); the key is read, not ignored."""
    resp = _post(client, {**LLAMA, "max_position_embeddings": 131072, "seq_length": 4096})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["estimate"]["max_model_len"] == 4096
    assert max(c["max_model_len"] for c in body["context_caps"]) == 4096
    assert not [k for k in body["ignored_keys"] if k["key"] == "seq_length"]


def test_model_max_length_overrides_the_minimum() -> None:
    """convertor L422-L425 (Command-R): a truthy model_max_length replaces the minimum."""
    out = derive_max_model_len({**LLAMA, "model_max_length": 131072})
    assert (out["max_model_len"], out["key"]) == (131072, "model_max_length")


def test_linear_rope_factor_scales_the_cap(client: TestClient) -> None:
    """model.py L2584-L2616: factor applied for rope types other than su/longrope/llama3/
    yarn/deepseek_*: 8192 x 4.0 = 32768, and max_model_len 32768 is no false 422."""
    model = {**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    resp = _post(client, model)
    assert resp.status_code == 200, resp.text
    assert resp.json()["estimate"]["max_model_len"] == 32768
    assert not [k for k in resp.json()["ignored_keys"] if k["key"] == "rope_scaling"]
    assert _post(client, model, max_model_len=32768).status_code == 200
    resp = _post(client, model, max_model_len=32769)
    assert resp.status_code == 422
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in resp.json()["detail"]


@pytest.mark.parametrize(
    ("rope", "extra", "cap"),
    [
        ({"type": "dynamic", "factor": 2.0}, {}, 16384),  # legacy "type" (config.py L587)
        ({"rope_type": "yarn", "factor": 4.0}, {}, 8192),  # yarn: not applied (L2594)
        ({"rope_type": "llama3", "factor": 8.0}, {}, 8192),
        ({"rope_type": "default"}, {}, 8192),
        ({"rope_type": "linear", "factor": None}, {}, 8192),  # null -> 1.0 (L2606-L2614)
        # longrope: the default is original_max_position_embeddings (L2624-L2631)
        (
            {"rope_type": "longrope", "factor": 4.0},
            {"original_max_position_embeddings": 4096},
            4096,
        ),
        ({"type": "su"}, {"original_max_position_embeddings": 4096}, 4096),  # su -> longrope
    ],
)
def test_rope_rules(rope: dict[str, Any], extra: dict[str, Any], cap: int) -> None:
    assert derive_max_model_len({**LLAMA, **extra, "rope_scaling": rope})["max_model_len"] == cap


def test_gemma3_is_not_scaled_again() -> None:
    """model.py L2580-L2583: Gemma3's length is already scaled."""
    model = {
        **LLAMA,
        "model_type": "gemma3_text",
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    assert derive_max_model_len(model)["max_model_len"] == 8192


def test_unknown_rope_type_is_unknown_not_a_number(client: TestClient) -> None:
    with pytest.raises(KVCacheUnknown) as err:
        derive_max_model_len({**LLAMA, "rope_scaling": {"rope_type": "mystery", "factor": 2.0}})
    assert err.value.loc == ("model", "rope_scaling", "rope_type")
    resp = _post(client, {**LLAMA, "rope_scaling": {"rope_type": "mystery", "factor": 2.0}})
    assert resp.status_code == 422
    assert resp.json()["errors"][0]["loc"] == ["body", "model", "rope_scaling", "rope_type"]


def test_no_length_key_is_vllm_default_2048_with_a_note() -> None:
    """model.py L2559-L2575: none of the keys -> the given max_model_len, else 2048 (warned)."""
    base = {k: v for k, v in LLAMA.items() if k != "max_position_embeddings"}
    out = derive_max_model_len(base)
    assert out["max_model_len"] == 2048 and out["notes"]
    assert derive_max_model_len(base, {"max_model_len": 100000})["max_model_len"] == 100000
    with pytest.raises(KVConfigError):
        derive_max_model_len(None)


def test_head_dim_zero_is_missing_as_in_vllm(client: TestClient) -> None:
    """model_arch_config_convertor.py L102-L107: head_dim 0 is read as missing
    ("materialize a missing head_dim as 0", DeepseekVLV2TextConfig) -> hidden // heads;
    the answer says so (a note), the figure is vLLM's."""
    model = {**LLAMA, "head_dim": 0, "hidden_size": 4096}
    resp = _post(client, model)
    assert resp.status_code == 200, resp.text
    assert any("head_dim 0" in a for a in resp.json()["assumptions"])


def test_v_head_dim_outside_mla_is_unknown(client: TestClient) -> None:
    """mimo_v2.py L251-L313: a non-MLA model passes head_size_v = v_head_dim to Attention,
    which changes the page size (model code): unknown, named; equal to head_dim is fine."""
    resp = _post(client, {**LLAMA, "v_head_dim": 64})
    assert resp.status_code == 422
    assert resp.json()["errors"][0]["loc"] == ["body", "model", "v_head_dim"]
    assert _post(client, {**LLAMA, "v_head_dim": 128}).status_code == 200


def test_kv_lora_rank_without_model_type_is_unknown(client: TestClient) -> None:
    """is_deepseek_mla (model_arch_config_convertor.py L314-L316): no model_type, no MLA;
    the estimator does not guess the layout."""
    resp = _post(client, {**LLAMA, "kv_lora_rank": 512, "qk_rope_head_dim": 64})
    assert resp.status_code == 422
    assert resp.json()["errors"][0]["loc"] == ["body", "model", "model_type"]
