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
    and 1.56x at 20,000 tokens; at 29,000 tokens the cap did not fit (23,648 tokens)."""
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
    """The question from the issue: context cap and concurrency on 2 x 80 GB at TP=2."""
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
    slid = client.post(
        "/api/v1/analyze/kv-cache",
        json={"model": {**LLAMA, "sliding_window": 4096}, "memory": {"available_kv_cache_gib": 8}},
    ).json()
    assert any("sliding_window 4096 ignored" in a for a in slid["assumptions"])
