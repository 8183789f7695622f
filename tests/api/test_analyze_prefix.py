"""``POST /api/v1/analyze/prefix`` through the API, on a real case (the generated
``tiny`` model's own tokenizer and Llama-3-style chat template)."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from tests.api.test_api import PROBLEM

CASE = Path(__file__).resolve().parent.parent / "orchestrator" / "analysis" / "data" / "prefix"


def test_clock_in_the_system_prompt(client: TestClient) -> None:
    case = json.loads((CASE / "clock_in_system_prompt.json").read_text())
    resp = client.post(
        "/api/v1/analyze/prefix",
        json={"model": "tiny", "requests": case["requests"], "block_size": 16},
    )
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["num_requests"] == 3
    div = out["divergence"]
    assert div["cause"] == case["expected"]["divergence_cause"] == "timestamp"
    first = div["locations"][0]
    assert first["message_index"] == 0 and first["role"] == "system"
    # the shared prefix stops at the clock: whole blocks only, and far below the prompt
    assert out["shared_prefix_blocks"] == out["shared_prefix_tokens"] // 16
    assert out["shared_prefix_tokens"] < min(out["prompt_tokens"]) // 2
    assert out["advice"] and out["predicted_hit_rate_after_advice"] > out["prediction"]["hit_rate"]


def test_bad_requests_are_problems(client: TestClient) -> None:
    resp = client.post("/api/v1/analyze/prefix", json={"model": "tiny", "requests": [{}]})
    assert resp.status_code == 422 and resp.headers["content-type"] == PROBLEM
    assert resp.json()["errors"][0]["loc"] == ["body", "requests"]
    assert resp.json()["errors"][0]["msg"].startswith("requests[0]: ")
    # a lone surrogate, as JSON allows it to be escaped (raw text: httpx cannot encode it)
    raw = r'{"model": "tiny", "requests": [{"prompt": "ok"}, {"prompt": "bad \ud800 x"}]}'
    resp = client.post(
        "/api/v1/analyze/prefix", content=raw, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 422 and "requests[1]: text is not valid Unicode" in resp.text
    resp = client.post("/api/v1/analyze/prefix", json={"model": "tiny", "requests": []})
    assert resp.status_code == 422
    resp = client.post(
        "/api/v1/analyze/prefix", json={"model": "nope", "requests": [{"prompt": "x"}]}
    )
    assert resp.status_code == 422 and "nope" in resp.json()["detail"]
