"""``POST /api/v1/analyze/kv-cache``: what-if KV cache questions, answered before any GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.test_api import PROBLEM

CASES = Path(__file__).resolve().parent.parent / "orchestrator" / "analysis" / "data" / "kvcache"


def _case() -> dict[str, Any]:
    return json.loads((CASES / "llama31_8b_24gib.json").read_text())


def test_a_real_case_as_a_what_if(client: TestClient) -> None:
    """Llama-3.1-8B on a 24 GiB card (vLLM issue 10517): the engine printed 1,952 blocks
    and 1.56x at 20,000 tokens; at 29,000 tokens the cap did not fit (23,648 tokens).
    Blocks = available // bytes per block, concurrency = blocks / cdiv(len, 16)
    (vLLM 0.32.0 vllm/v1/core/kv_cache_utils.py L1627, L1195-L1227)."""
    case = _case()
    prof = case["memory_profile_gib"]
    body = {
        "model": case["model"],
        "engine": {**case["engine"], "max_model_len": 20000},
        # peak torch memory (weights + activation) as the profile printed it
        "memory": {
            "device_memory_gib": prof["total_gpu_memory"],
            "weights_gib": prof["peak_torch_memory"],
            "non_torch_gib": prof["non_torch_memory"],
        },
    }
    resp = client.post("/api/v1/analyze/kv-cache", json=body)
    assert resp.status_code == 200, resp.text
    est = resp.json()["estimate"]
    expected = case["cases"][0]["expected"]
    assert est["kv_bytes_per_token"] == expected["kv_bytes_per_token"]
    assert abs(est["gpu_blocks"] - expected["gpu_blocks_approx"]) <= expected["blocks_tolerance"]
    assert round(est["maximum_concurrency"], 2) == expected["maximum_concurrency"]
    assert est["fits"] is True

    second = case["cases"][1]
    body["engine"]["max_model_len"] = second["max_model_len"]
    body["memory"]["weights_gib"] = second["memory_profile_gib_override"]["peak_torch_memory"]
    out = client.post("/api/v1/analyze/kv-cache", json=body).json()
    tokens = out["estimate"]["kv_cache_tokens"]
    assert abs(tokens - second["expected"]["kv_cache_tokens_approx"]) <= 3 * 16
    assert out["estimate"]["fits"] is False
    assert out["estimate"]["advice"] == second["expected"]["advice"]


def test_what_fits_on_two_80gb_at_tp2(client: TestClient) -> None:
    """The question from the issue: context cap and concurrency on 2 x 80 GB at TP=2; TP
    splits the KV heads (vLLM 0.32.0 vllm/config/model.py L1670)."""
    case = _case()
    body = {
        "model": {**case["model"], "max_position_embeddings": 131072},
        "engine": {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.9},
        "memory": {"device_memory_gib": 80, "weights_gib": 7.5, "activation_gib": 1.5},
        "concurrency": 16,
    }
    out = client.post("/api/v1/analyze/kv-cache", json=body).json()
    est = out["estimate"]
    # TP=2 halves the KV heads per GPU: 2 x 32 x 4 x 128 x 2 = 64 KiB per token
    assert est["kv_bytes_per_token"] == 65536 and out["devices"] == 2
    # (80 x 0.9 - 7.5 - 1.5) GiB = 63 GiB -> 63 x 2**30 / 64 KiB = 1,032,192 tokens
    assert est["kv_cache_tokens"] == 1032192
    assert est["max_model_len"] == 131072 and est["fits"] is True
    assert out["max_model_len_for_concurrency"]["max_model_len"] == 1032192 // 16
    caps = {row["max_model_len"]: row for row in out["context_caps"]}
    assert caps[131072]["maximum_concurrency"] == round(1032192 / 131072, 2)
    assert out["assumptions"] == []  # every figure was given


def test_named_model_and_bad_input(client: TestClient) -> None:
    # the generated "tiny" model has no weight files (served with --load-format dummy)
    resp = client.post(
        "/api/v1/analyze/kv-cache", json={"model": "tiny", "memory": {"device_memory_gib": 16}}
    )
    assert resp.status_code == 422 and resp.headers["content-type"] == PROBLEM
    assert resp.json()["errors"][0]["loc"] == ["body", "memory", "weights_gib"]
    ok = client.post(
        "/api/v1/analyze/kv-cache",
        json={"model": "tiny", "memory": {"available_kv_cache_gib": 1.0}},
    )
    assert ok.status_code == 200 and ok.json()["estimate"]["kv_cache_tokens"] > 0
    resp = client.post(
        "/api/v1/analyze/kv-cache",
        json={"model": "no-such-model", "memory": {"device_memory_gib": 1}},
    )
    assert resp.status_code == 422 and "no-such-model" in resp.json()["detail"]
    resp = client.post(
        "/api/v1/analyze/kv-cache",
        json={"model": {"num_attention_heads": 8}, "memory": {"available_kv_cache_gib": 1}},
    )
    assert resp.status_code == 422
    resp = client.post("/api/v1/analyze/kv-cache", json={"model": "tiny", "memory": {}})
    assert resp.status_code == 422 and resp.json()["errors"][0]["loc"] == ["body", "memory"]


LLAMA = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
}


@pytest.mark.parametrize(
    ("body", "loc", "words"),
    [
        # layouts vLLM refuses
        ({"engine": {"tensor_parallel_size": 3}}, ["engine", "tensor_parallel_size"], "divide"),
        ({"engine": {"tensor_parallel_size": 64}}, ["engine", "tensor_parallel_size"], "divide"),
        ({"engine": {"pipeline_parallel_size": 64}}, ["engine", "pipeline_parallel_size"], "64"),
        ({"engine": {"max_model_len": 1_000_000}}, ["engine", "max_model_len"], "131072"),
        # configs that are not sane numbers
        ({"model": {**LLAMA, "num_key_value_heads": 0}}, ["model", "num_key_value_heads"], "1"),
        ({"model": {**LLAMA, "num_hidden_layers": "32"}}, ["model", "num_hidden_layers"], "'32'"),
        ({"model": {**LLAMA, "num_hidden_layers": 32.5}}, ["model", "num_hidden_layers"], "32.5"),
        ({"model": {**LLAMA, "head_dim": 10**300}}, ["model", "head_dim"], "65536"),
        ({"model": {**LLAMA, "num_key_value_heads": 64}}, ["model", "num_key_value_heads"], "64"),
        ({"model": {**LLAMA, "num_key_value_heads": 5}}, ["model", "num_key_value_heads"], "5"),
        ({"engine": {"kv_cache_dtype": "fp7"}}, ["engine", "kv_cache_dtype"], "fp7"),
        # memory figures: infinite, absurd, or both kinds at once
        (
            {"memory": {"device_memory_gib": 80, "weights_gib": 1e308}},
            ["memory", "weights_gib"],
            "",
        ),
        (
            {"memory": {"available_kv_cache_gib": 1, "device_memory_gib": 80}},
            ["memory"],
            "not both",
        ),
    ],
)
def test_refusals_name_the_field(
    client: TestClient, body: dict[str, Any], loc: list[str], words: str
) -> None:
    doc: dict[str, Any] = {
        "model": LLAMA,
        "engine": {},
        "memory": {"device_memory_gib": 80, "weights_gib": 15},
    }
    doc.update(body)
    resp = client.post("/api/v1/analyze/kv-cache", json=doc)
    assert resp.status_code == 422, resp.text
    assert resp.headers["content-type"] == PROBLEM
    err = resp.json()["errors"][0]
    assert err["loc"][1:] == loc and words in err["msg"]


def test_infinity_and_no_room_left(client: TestClient) -> None:
    raw = '{"model": "tiny", "memory": {"device_memory_gib": 8, "weights_gib": Infinity}}'
    resp = client.post(
        "/api/v1/analyze/kv-cache", content=raw, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 422
    out = client.post(
        "/api/v1/analyze/kv-cache",
        json={"model": LLAMA, "memory": {"device_memory_gib": 8, "weights_gib": 20}},
    ).json()
    assert out["estimate"]["kv_cache_tokens"] == 0 and out["estimate"]["fits"] is False
    assert any("no memory is left" in a for a in out["assumptions"])


KV = "/api/v1/analyze/kv-cache"
MEM = {"available_kv_cache_gib": 8}


def test_sliding_window_is_modelled_or_refused(client: TestClient) -> None:
    """A window without ``layer_types`` on an unknown model type is not guessed (422 naming
    ``sliding_window``); with ``layer_types`` the window layers are their own groups, and
    the tokens in flight they keep need ``max_num_batched_tokens``
    (vllm/v1/kv_cache_interface.py L859-L885, vllm/config/vllm.py L577-L598)."""
    resp = client.post(KV, json={"model": {**LLAMA, "sliding_window": 4096}, "memory": MEM})
    assert resp.status_code == 422 and resp.headers["content-type"] == PROBLEM
    err = resp.json()["errors"][0]
    assert err["loc"] == ["body", "model", "sliding_window"] and "kv_bytes_per_token" in err["msg"]
    hybrid = {
        **LLAMA,
        "sliding_window": 4096,
        "layer_types": ["sliding_attention", "full_attention"] * 16,
    }
    resp = client.post(KV, json={"model": hybrid, "memory": MEM})
    assert resp.json()["errors"][0]["loc"] == ["body", "engine", "max_num_batched_tokens"]
    eng = {"max_num_batched_tokens": 8192, "async_scheduling": False}
    out = client.post(KV, json={"model": hybrid, "engine": eng, "memory": MEM}).json()
    groups = out["estimate"]["kv_cache_groups"]
    assert [(g["kind"], g["layers"]) for g in groups] == [("sliding", 16), ("full", 16)]


def test_speculative_decoding_through_the_api(client: TestClient) -> None:
    """MTP layers come from the config's ``num_nextn_predict_layers``
    (vllm/model_executor/models/deepseek_mtp.py L152); an EAGLE head needs its own config
    (``draft_model``), else 422 naming it."""
    mla = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 163840,
    }
    body = {
        "model": mla,
        "memory": MEM,
        "engine": {
            "tensor_parallel_size": 8,
            "kv_cache_dtype": "fp8",
            "speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
        },
    }
    out = client.post(KV, json=body).json()
    assert out["estimate"]["kv_bytes_per_token"] == 62 * 576
    assert out["estimate"]["speculative"]["drafter_kv_layers"] == 1
    spec = {
        "method": "eagle3",
        "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "num_speculative_tokens": 3,
    }
    resp = client.post(
        KV, json={"model": LLAMA, "memory": MEM, "engine": {"speculative_config": spec}}
    )
    assert resp.status_code == 422
    assert resp.json()["errors"][0]["loc"] == ["body", "draft_model"]
    head = {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "draft_vocab_size": 32000,
    }
    ok = client.post(
        KV,
        json={
            "model": LLAMA,
            "draft_model": head,
            "memory": MEM,
            "engine": {"speculative_config": spec},
        },
    ).json()
    assert ok["estimate"]["kv_bytes_per_token"] == 33 * 2 * 8 * 128 * 2


def test_unknown_keys_are_visible_and_fp8_halves(client: TestClient) -> None:
    """Any vLLM engine argument is accepted; one the estimator does not know is listed in
    ``ignored_keys`` with the reason, and so is an unknown model config key; known ones
    that do not change the KV cache (``max_num_seqs``, ``rope_scaling``) are not."""
    model = {**LLAMA, "rope_scaling": {"factor": 8.0}, "attn_magic_ratio": 3}
    eng = {"kv_cache_dtype": "fp8", "max_num_seqs": 64, "tensor_paralel_size": 2}
    out = client.post(KV, json={"model": model, "engine": eng, "memory": MEM}).json()
    assert out["estimate"]["kv_bytes_per_token"] == 2 * 32 * 8 * 128
    assert {e["key"] for e in out["ignored_keys"]} == {"attn_magic_ratio", "tensor_paralel_size"}
    assert all(e["reason"] for e in out["ignored_keys"])
    resp = client.post(
        KV, json={"model": LLAMA, "memory": MEM, "engine": {"decode_context_parallel_size": 2}}
    )
    assert resp.status_code == 422
    assert resp.json()["errors"][0]["loc"] == ["body", "engine", "decode_context_parallel_size"]


def test_given_bytes_per_token(client: TestClient) -> None:
    """A model the estimator refuses (Mamba layers) is answered from a given
    ``kv_bytes_per_token``; the answer says the figure was given. Without a model the cap
    must be given."""
    jamba = {**LLAMA, "layers_block_type": ["mamba"] * 28 + ["attention"] * 4}
    resp = client.post(KV, json={"model": jamba, "memory": MEM})
    assert resp.status_code == 422
    assert resp.json()["errors"][0]["loc"] == ["body", "model", "layers_block_type"]
    out = client.post(KV, json={"model": jamba, "memory": MEM, "kv_bytes_per_token": 16384}).json()
    assert out["kv_bytes_per_token_source"] == "given"
    assert out["estimate"]["kv_bytes_per_token"] == 16384
    assert out["estimate"]["kv_bytes_per_token_modelled"] is None
    assert out["estimate"]["kv_cache_tokens"] == 8 * 2**30 // 16384
    bare = client.post(KV, json={"kv_bytes_per_token": 16384, "memory": MEM})
    assert bare.json()["errors"][0]["loc"] == ["body", "engine", "max_model_len"]
    bare = client.post(
        KV, json={"kv_bytes_per_token": 16384, "memory": MEM, "engine": {"max_model_len": 8192}}
    )
    assert bare.status_code == 200 and bare.json()["estimate"]["maximum_concurrency"] == 64.0
    fixed = client.post(
        KV, json={"model": LLAMA, "engine": {"kv_cache_memory_bytes": 2**30}}
    ).json()
    assert fixed["estimate"]["gpu_blocks"] == 512
