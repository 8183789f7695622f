"""Found by a fresh user's trial of the hardened service: each case is a 4xx, never a 500
or a leak."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fastapi.testclient import TestClient

from orchestrator.experiments.engine_catalog import EngineArgCatalog
from orchestrator.experiments.pathpolicy import PathPolicy
from orchestrator.experiments.planner import public_reason
from tests.api.test_api import demo_spec
from tests.factories import DATA


def test_a_new_file_under_a_linked_folder_is_outside_the_roots(tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    (root / "etclink").symlink_to("/etc")
    policy = PathPolicy.of([str(root)], False)
    assert policy.path_problem(str(root / "etclink" / "newdir")) is not None
    assert policy.path_problem(str(root / "etclink" / "passwd")) is not None
    assert policy.path_problem(str(root / "plain" / "newdir")) is None


def test_deeply_nested_json_text_is_a_422(client: TestClient) -> None:
    spec = demo_spec()
    deep = '{"a":' * 1200 + "1" + "}" * 1200
    spec["baseline"]["engine_args"]["speculative_config"] = deep
    resp = client.post("/api/v1/experiments", json=spec)
    assert resp.status_code == 422, resp.text[:500]
    assert "nested deeper" in json.dumps(resp.json()["errors"])


def test_thousands_of_bad_fields_give_a_bounded_answer(client: TestClient) -> None:
    spec = demo_spec()
    spec["baseline"]["engine_args"] = {f"no_such_arg_{i}": 1 for i in range(2000)}
    resp = client.post("/api/v1/experiments", json=spec)
    assert resp.status_code == 422
    errors = resp.json()["errors"]
    assert len(errors) == 201 and errors[-1]["type"] == "truncated"


def test_an_overlong_id_is_not_echoed_whole(client: TestClient) -> None:
    resp = client.get("/api/v1/runs/" + "x" * 5000)
    assert resp.status_code in (404, 422)
    assert len(resp.json()["detail"]) <= 2001


def test_vllm_refusals_carry_no_class_names_paths_or_pydantic_noise() -> None:
    raw = (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig\n"
        "max_num_seqs\n  Input should be greater than or equal to 1 [type=greater_than_equal, "
        "input_value=-1, input_type=int]\n    For further information visit "
        "https://errors.pydantic.dev/2.12/v/greater_than_equal"
    )
    assert public_reason(raw) == "max_num_seqs Input should be greater than or equal to 1"
    leak = (
        "VLLMValidationError: The supplied chat template string (missing.jinja) appears "
        "path-like, but doesn't exist! Tried: "
        f"{os.sep}srv{os.sep}.engine-venv/lib/python3.11/site-packages/vllm/x/missing.jinja"
    )
    cleaned = public_reason(leak)
    assert "Error" not in cleaned and "site-packages" not in cleaned
    assert "missing.jinja" in cleaned


def test_catalog_refuses_deep_json_before_parsing() -> None:
    catalog = EngineArgCatalog.from_doc(
        json.loads((DATA / "engine_args_vllm032cpu.json").read_text())
    )
    deep = "[" * 5000 + "]" * 5000
    (err,) = catalog.check({"speculative_config": deep}, ["x"])
    assert err["type"] == "bad_engine_arg_value"


def test_a_file_uri_is_refused_as_a_file_uri_not_a_relative_path(client: TestClient) -> None:
    """Issue 23's trial: ``chat_template: "file:///etc/passwd"`` was refused as "a relative
    path"."""
    spec = demo_spec()
    spec["baseline"]["engine_args"]["chat_template"] = "file:///etc/passwd"
    resp = client.post("/api/v1/experiments", json=spec)
    assert resp.status_code == 422, resp.text[:500]
    (err,) = [e for e in resp.json()["errors"] if e["type"] == "path_not_allowed"]
    assert err["loc"][-1] == "chat_template"
    assert "refused: a file: URI, not a path" in err["msg"], err["msg"]
