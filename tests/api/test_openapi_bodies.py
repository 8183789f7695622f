"""Every success body of the API is described in ``/openapi.json``, and the typed
answers are the analyses' documents as they are.

A route that returns ``dict[str, Any]`` gets a free-form object schema (``{"type":
"object", "additionalProperties": true}``): valid OpenAPI that says nothing about the
body. This walks ``app.openapi()`` and fails for every ``/api`` operation whose 200, 201
or 202 response has no schema, or a JSON schema that names no field (no ``$ref``, no
``properties``, no typed ``items`` or ``additionalProperties``), so each new route
declares its response model (:mod:`api.schemas`).

A response model drops a key it does not declare: the routes whose answer is an
analysis' document (the comparison, the findings, the KV cache and prefix what-ifs) are
checked key for key, value for value (as JSON text) against the document the analysis
returns, so a key the analysis adds fails here until the model declares it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.schemas import KVEngine, KVMemory
from orchestrator.analysis import kvcache
from orchestrator.analysis.prefix import analyze_prefix
from orchestrator.analysis.service import comparison, experiment_advice, run_advice
from tests.web.seed import DATA, load_export

SUCCESS = ("200", "201", "202")
HTTP_METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


def _resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if not isinstance(ref, str):
        return schema
    node: Any = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return _resolve(doc, node)


def described(doc: dict[str, Any], schema: dict[str, Any] | None, json_body: bool) -> bool:
    """Whether ``schema`` says what the body holds: for JSON, named fields (a model),
    a list or map of described items, or a union of described ones; for other media
    (CSV, Parquet, text) any schema."""
    if not schema:
        return False
    if not json_body:
        return True
    schema = _resolve(doc, schema)
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return all(described(doc, s, True) for s in schema[key])
    kind = schema.get("type")
    if kind == "array":
        return described(doc, schema.get("items"), True)
    if kind == "object" or "properties" in schema or "additionalProperties" in schema:
        extra = schema.get("additionalProperties")
        if schema.get("properties"):
            return True
        return isinstance(extra, dict) and bool(extra) and described(doc, extra, True)
    return kind in ("string", "integer", "number", "boolean", "null")


def undescribed_bodies(doc: dict[str, Any]) -> list[str]:
    """``METHOD path status media`` of every ``/api`` success response not described."""
    out = []
    for path, item in doc.get("paths", {}).items():
        if not path.startswith("/api/"):
            continue
        for method, op in item.items():
            if method not in HTTP_METHODS:
                continue
            for status, response in op.get("responses", {}).items():
                if status not in SUCCESS:
                    continue
                content = response.get("content") or {}
                if not content:
                    out.append(f"{method.upper()} {path} {status}: no content")
                for media, body in content.items():
                    json_body = media == "application/json" or media.endswith("+json")
                    if not described(doc, body.get("schema"), json_body):
                        out.append(f"{method.upper()} {path} {status} {media}")
    return sorted(out)


def test_every_api_success_body_has_a_schema(client: TestClient) -> None:
    doc = client.app.openapi()  # type: ignore[attr-defined]
    operations = sum(
        1
        for path, item in doc["paths"].items()
        if path.startswith("/api/")
        for method in item
        if method in HTTP_METHODS
    )
    assert operations >= 30, f"only {operations} /api operations: is the API mounted?"
    assert undescribed_bodies(doc) == []


def test_the_check_finds_a_free_form_body() -> None:
    """A ``dict[str, Any]`` response (what FastAPI writes for it) and an empty schema fail;
    a model, a list of models and a map of numbers pass."""
    doc = {
        "components": {
            "schemas": {"M": {"type": "object", "properties": {"a": {"type": "integer"}}}}
        },
        "paths": {
            "/api/free": {
                "get": {
                    "responses": {
                        "200": {
                            "content": {
                                "application/json": {
                                    "schema": {"type": "object", "additionalProperties": True}
                                }
                            }
                        }
                    }
                },
                "post": {"responses": {"201": {"content": {"application/json": {"schema": {}}}}}},
            },
            "/api/typed": {
                "get": {
                    "responses": {
                        "200": {
                            "content": {
                                "application/json": {"schema": {"$ref": "#/components/schemas/M"}}
                            }
                        }
                    }
                },
                "post": {
                    "responses": {
                        "201": {
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "type": "array",
                                        "items": {"$ref": "#/components/schemas/M"},
                                    }
                                }
                            }
                        }
                    }
                },
                "put": {
                    "responses": {
                        "200": {
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "type": "object",
                                        "additionalProperties": {"type": "number"},
                                    }
                                }
                            }
                        }
                    }
                },
            },
            "/healthz": {"get": {"responses": {"200": {"content": {}}}}},
        },
    }
    assert undescribed_bodies(doc) == [
        "GET /api/free 200 application/json",
        "POST /api/free 201 application/json",
    ]


def _text(doc: Any) -> str:
    """JSON text, keys sorted: ``3`` and ``3.0`` differ, as they do on the wire."""
    return json.dumps(doc, sort_keys=True)


def test_typed_answers_are_the_analysis_documents(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    with session_factory.begin() as s:
        ids = load_export(s, DATA / "demo_experiment.json", name=f"bodies-{uuid.uuid4().hex[:6]}")
    exp_id, run_id = ids["experiment_id"], ids["runs"]["apc-on#0"]
    with session_factory() as s:
        expected = {
            f"/api/v1/experiments/{exp_id}/comparison": comparison(s, exp_id),
            f"/api/v1/experiments/{exp_id}/findings": {
                "experiment_id": exp_id,
                "findings": experiment_advice(s, exp_id),
            },
            f"/api/v1/runs/{run_id}/findings": {
                "run_id": run_id,
                "findings": run_advice(s, run_id),
            },
        }
    assert expected[f"/api/v1/experiments/{exp_id}/comparison"]["variants"]
    for url, doc in expected.items():
        response = client.get(url)
        assert response.status_code == 200, response.text
        assert _text(response.json()) == _text(doc), url


def test_typed_what_ifs_are_the_analysis_documents(client: TestClient) -> None:
    """The KV cache answer with and without its optional parts (the model's shape, the cap
    for a concurrency, a given ``kv_bytes_per_token``) and the prefix analysis."""
    config = {
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    memory = {"available_kv_cache_gib": 0.5}
    bodies: list[dict[str, Any]] = [
        {"model": config, "memory": memory, "concurrency": 4},
        {"kv_bytes_per_token": 4096, "engine": {"max_model_len": 2048}, "memory": memory},
        {"model": config, "kv_bytes_per_token": 4096, "memory": memory},
    ]
    for body in bodies:
        response = client.post("/api/v1/analyze/kv-cache", json=body)
        assert response.status_code == 200, response.text
        doc = kvcache.what_fits(
            body.get("model"),
            KVEngine(**body.get("engine", {})).model_dump(exclude_none=True),
            kvcache.MemoryProfile(**KVMemory(**memory).model_dump()),
            kv_bytes_per_token=body.get("kv_bytes_per_token"),
            concurrency=body.get("concurrency"),
        )
        assert _text(response.json()) == _text(doc)
    requests = [{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9]}, {"prompt": [1, 2, 3, 4, 5, 6, 7, 10]}]
    response = client.post("/api/v1/analyze/prefix", json={"requests": requests, "block_size": 4})
    assert response.status_code == 200, response.text
    expected = analyze_prefix(requests, None, block_size=4).model_dump(mode="json")
    assert _text(response.json()) == _text(expected)
