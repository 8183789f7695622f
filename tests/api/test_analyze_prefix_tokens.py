"""``POST /api/v1/analyze/prefix`` with prompts given as token ids (vLLM 0.32
``CompletionRequest.prompt: list[int] | list[list[int]]``,
``vllm/entrypoints/openai/completion/protocol.py`` l.52) and without a model: the ids are
compared, the text requests are listed as not compared."""

from __future__ import annotations

from fastapi.testclient import TestClient


def test_token_ids_without_a_model(client: TestClient) -> None:
    base = list(range(10, 60))
    body = {
        "requests": [
            {"prompt": [[*base, 1, 2], [*base, 3, 4]]},
            {"messages": [{"role": "user", "content": "hi"}]},
        ],
        "block_size": 16,
    }
    resp = client.post("/api/v1/analyze/prefix", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["model_dir"] is None and out["num_requests"] == 2
    assert out["request_sources"] == ["requests[0].prompt[0]", "requests[0].prompt[1]"]
    assert out["shared_prefix_tokens"] == len(base)
    assert out["prediction"]["hits_tokens"] == 16 * (len(base) // 16)
    assert [x["request"] for x in out["not_compared"]] == ["requests[1]"]
    assert out["divergence"]["cause"] == "other" and out["divergence"]["label"] == "other content"


def test_token_ids_with_the_model_and_bad_ids(client: TestClient) -> None:
    resp = client.post(
        "/api/v1/analyze/prefix", json={"model": "tiny", "requests": [{"prompt": [1, -3]}]}
    )
    assert resp.status_code == 422 and "prompt[1] must be a token id" in resp.text
    resp = client.post(
        "/api/v1/analyze/prefix", json={"model": "tiny", "requests": [{"prompt": [1, 10**9]}]}
    )
    assert resp.status_code == 422 and "Token id 1000000000 is out of vocabulary" in resp.text
    resp = client.post("/api/v1/analyze/prefix", json={"requests": [{"prompt": "text"}]})
    assert resp.status_code == 422 and "no request can be compared" in resp.text
