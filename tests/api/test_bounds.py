"""Bounds and parsing at the API's edge (issue #13): integers bounded by the columns
that store them, names length-checked before the file system sees them, a request
body limit, and the path policy on every endpoint that takes engine arguments."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from orchestrator.core.settings import LimitsSettings, PathSettings, Settings
from orchestrator.experiments import model_resolution as service

PROBLEM = "application/problem+json"
LONG_MODEL = "m" * 300


def spec(**kw: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "bounds",
        "model": "tiny",
        "baseline": {
            "engine_args": {"max_model_len": 1024},
            "workload": {"num_requests": 2, "prefix_tokens": 64, "seed": 3},
        },
        "repeats": 1,
    }
    doc.update(kw)
    return doc


def errors_of(resp: Any) -> set[tuple[str, str]]:
    assert resp.headers["content-type"].startswith(PROBLEM), resp.text
    return {(".".join(map(str, e["loc"])), e["type"]) for e in resp.json().get("errors", [])}


def test_seed_beyond_the_32_bit_column_is_a_422(client: TestClient) -> None:
    doc = spec()
    doc["baseline"]["workload"]["seed"] = 2**31
    resp = client.post("/api/v1/experiments", json=doc)
    assert resp.status_code == 422, resp.text
    assert ("body.baseline.workload.seed", "less_than_equal") in errors_of(resp)
    doc["baseline"]["workload"]["seed"] = 2**31 - 1
    ok = client.post("/api/v1/experiments", json=doc)
    assert ok.status_code == 201, ok.text
    run = client.get(ok.json()["runs"][0]["url"]).json()
    assert run["seed"] == 2**31 - 1


def test_seed_through_a_variant_is_checked_too(client: TestClient) -> None:
    doc = spec(variants=[{"name": "s", "changes": {"workload.seed": 2**40}}])
    resp = client.post("/api/v1/experiments", json=doc)
    assert resp.status_code == 422, resp.text


def test_context_cap_beyond_the_column_is_a_422(client: TestClient) -> None:
    for value in ("2T", 2**31):
        doc = spec()
        doc["baseline"]["engine_args"]["max_model_len"] = value
        resp = client.post("/api/v1/experiments", json=doc)
        assert resp.status_code == 422, resp.text
        assert ("body.baseline.engine_args.max_model_len", "bad_engine_arg_value") in errors_of(
            resp
        )


def test_factor_levels_that_make_odd_names_are_not_a_500(client: TestClient) -> None:
    doc = spec(factors=[{"name": "tok", "paths": ["engine_args.tokenizer"], "levels": ["a/b"]}])
    resp = client.post("/api/v1/experiments", json=doc)
    assert resp.status_code in (201, 422), resp.text
    if resp.status_code == 201:
        assert [r["name"] for r in resp.json()["runs"]] == ["baseline", "tok=a_b"]


@pytest.fixture
def no_lookups(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Fail the test if a model name reaches a node's (or this host's) model look-up."""
    asked: list[str] = []

    def locator(settings: Settings, model: str, revision: str | None) -> dict[str, Any]:
        asked.append(model)
        raise AssertionError(f"{model[:20]}... reached the model look-up")

    monkeypatch.setattr(service, "_locator", locator)
    yield asked


def test_a_300_character_model_is_a_422_on_every_endpoint(
    client: TestClient, no_lookups: list[str]
) -> None:
    calls = [
        ("/api/v1/experiments", spec(model=LONG_MODEL)),
        ("/api/v1/experiments", spec(model="/" + LONG_MODEL)),
        ("/api/v1/analyze/kv-cache", {"model": LONG_MODEL, "memory": {"device_memory_gib": 8}}),
        ("/api/v1/analyze/prefix", {"model": LONG_MODEL, "requests": [{"prompt": "hi"}]}),
        ("/api/v1/cluster/parity", {"model": LONG_MODEL}),
        ("/api/v1/cluster/parity", {"model": "org/" + "x" * 296}),
    ]
    for url, body in calls:
        resp = client.post(url, json=body)
        assert resp.status_code == 422, (url, resp.text)
        assert resp.headers["content-type"].startswith(PROBLEM)
        text = json.dumps(resp.json())
        assert "255" in text, (url, text)
    assert no_lookups == []


def test_long_path_components_never_reach_the_file_system(tmp_path: Path) -> None:
    from orchestrator.core.errors import SpecInvalidError

    settings = Settings(home=tmp_path)
    with pytest.raises(SpecInvalidError) as exc:
        service.resolve_model(settings, "/tmp/" + "x" * 250)  # 255 chars, a 250-byte name
    assert exc.value.errors[0]["type"] != "bad_model_name"  # a legal name: just not a model
    with pytest.raises(SpecInvalidError) as exc:
        service.resolve_model(settings, "é" * 200)  # 200 characters, 400 bytes
    assert exc.value.errors[0]["type"] == "bad_model_name"


def test_a_body_above_the_limit_is_413_unread(client: TestClient, settings: Settings) -> None:
    limit = settings.limits.max_body_bytes
    assert limit == 16 * 2**20
    big = b'{"name": "' + b"x" * (20 * 2**20) + b'"}'
    resp = client.post(
        "/api/v1/experiments", content=big, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 413
    assert resp.headers["content-type"] == PROBLEM
    body = resp.json()
    assert body["code"] == "payload_too_large" and body["status"] == 413
    assert "VLAB_LIMITS__MAX_BODY_BYTES" in body["detail"] and body["max_bytes"] == limit


def test_a_chunked_body_above_the_limit_is_413(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the limit is read when the app is built: rebuild with a small one
    from api.app import create_app

    small = settings.model_copy(update={"limits": LimitsSettings(max_body_bytes=4096)})

    def chunks(n: int) -> Iterator[bytes]:
        yield b'{"name": "'
        for _ in range(n):
            yield b"x" * 1024
        yield b'"}'

    with TestClient(create_app(small, client.app.state.session_factory)) as c:  # type: ignore[attr-defined]
        resp = c.post(
            "/api/v1/analyze/kv-cache",
            content=chunks(10),
            headers={"content-type": "application/json"},
        )
        assert resp.status_code == 413 and resp.json()["code"] == "payload_too_large"
        ok = c.post(
            "/api/v1/analyze/kv-cache",
            content=chunks(1),
            headers={"content-type": "application/json"},
        )
        assert ok.status_code == 422  # read and parsed: a body under the limit gets through
        assert ok.json()["code"] != "payload_too_large"


def test_server_files_in_engine_args_are_refused_everywhere(client: TestClient) -> None:
    doc = spec()
    doc["baseline"]["engine_args"]["chat_template"] = "/etc/passwd"
    doc["variants"] = [{"name": "dl", "changes": {"engine_args.download_dir": "/"}}]
    resp = client.post("/api/v1/experiments", json=doc)
    assert resp.status_code == 422, resp.text
    got = errors_of(resp)
    assert ("body.baseline.engine_args.chat_template", "path_not_allowed") in got
    assert ("body.variants.0.changes.engine_args.download_dir", "path_not_allowed") in got
    msg = json.dumps(resp.json())
    assert "/etc/passwd" in msg and "VLAB_PATHS__ALLOWED_ROOTS" in msg

    factor = spec(factors=[{"name": "t", "paths": ["engine_args.tokenizer"], "levels": ["/etc"]}])
    resp = client.post("/api/v1/experiments", json=factor)
    assert resp.status_code == 422 and "path_not_allowed" in resp.text

    remote = spec()
    remote["baseline"]["engine_args"]["trust_remote_code"] = True
    resp = client.post("/api/v1/experiments", json=remote)
    assert resp.status_code == 422 and "code_not_allowed" in resp.text

    parity = client.post("/api/v1/cluster/parity", json={"engine_args": {"tokenizer": "/etc"}})
    assert parity.status_code == 422 and "path_not_allowed" in parity.text

    schedule = {
        "name": "nightly-paths",
        "cron": "0 2 * * *",
        "timezone": "UTC",
        "template": doc,
    }
    resp = client.post("/api/v1/schedules", json=schedule)
    assert resp.status_code == 422, resp.text
    assert "path_not_allowed" in resp.text


def test_inline_templates_and_paths_under_a_root_are_accepted(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    doc = spec()
    doc["baseline"]["engine_args"]["chat_template"] = "{{ messages[0]['content'] }}"
    resp = client.post("/api/v1/experiments", json=doc)
    assert resp.status_code == 201, resp.text

    root = tmp_path / "allowed"
    root.mkdir()
    settings.paths = PathSettings(allowed_roots=[root])
    doc = spec(name="under-root")
    doc["baseline"]["engine_args"]["chat_template"] = str(root / "chat.jinja")
    doc["variants"] = [{"name": "dl", "changes": {"engine_args.download_dir": str(root / "w")}}]
    resp = client.post("/api/v1/experiments", json=doc)
    assert resp.status_code == 201, resp.text


def test_a_cloned_variant_goes_through_the_policy_and_bounds(client: TestClient) -> None:
    created = client.post("/api/v1/experiments", json=spec(name="clone-policy"))
    assert created.status_code == 201, created.text
    run_id = created.json()["runs"][0]["id"]
    for changes, code in [
        ({"engine_args.chat_template": "/etc/passwd"}, "path_not_allowed"),
        ({"engine_args.trust_remote_code": True}, "code_not_allowed"),
        ({"workload.seed": 2**31}, "less_than_equal"),
    ]:
        resp = client.post(
            f"/api/v1/runs/{run_id}/variants", json={"name": "x", "changes": changes}
        )
        assert resp.status_code == 422, resp.text
        assert code in resp.text, resp.text
