"""The OpenAPI description tells the truth: schemathesis against the real app and database.

``st run`` (schemathesis) drives every operation of ``/openapi.json`` over real HTTP
(uvicorn in a thread) with generated valid and invalid requests, in a bounded number
of examples and a fixed seed, and checks: no 5xx, every status code and content
type declared (problem+json included), response bodies and headers as declared,
invalid requests refused, 405 with ``Allow``, authentication enforced. The check
"schema-valid requests are accepted" is left out: some refusals depend on state the
schema cannot describe (which models a node's cache holds, which cron expressions
ever fire, which tokens exist); those answer 404/409/422 problem+json, declared.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from api.app import create_app
from orchestrator.core import auth
from orchestrator.core.db import normalize_url, unit_of_work, upgrade_to_head
from orchestrator.core.settings import EngineSettings, Settings
from tests.api.livehttp import live_server
from tests.conftest import fresh_database
from tests.factories import DATA

ST = Path(sys.executable).with_name("st")


@pytest.mark.skipif(not ST.exists() and shutil.which("st") is None, reason="schemathesis missing")
def test_schemathesis_finds_no_contract_violation(tmp_path: Path, server_url: str) -> None:
    python = tmp_path / "engine-python-placeholder"
    settings = Settings(
        home=tmp_path / "home", engine=EngineSettings(python=python, resolve_configs=False)
    )
    settings.home.mkdir()
    doc = json.loads((DATA / "engine_args_vllm032cpu.json").read_text())
    doc["engine_python"] = str(python)
    settings.engine_args_cache.write_text(json.dumps(doc))
    with fresh_database(server_url) as url:
        upgrade_to_head(url)
        engine = create_engine(normalize_url(url))
        factory = sessionmaker(bind=engine, expire_on_commit=False)
        with unit_of_work(factory) as session:
            _, token = auth.create_token(session, name="contract", role="admin", created_by="test")
        try:
            with live_server(create_app(settings, factory)) as base:
                proc = subprocess.run(
                    [
                        str(ST if ST.exists() else shutil.which("st")),
                        "run",
                        f"{base}/openapi.json",
                        "-H",
                        f"Authorization: Bearer {token}",
                        "--max-examples",
                        "12",
                        "--seed",
                        "20261201",
                        "--exclude-checks",
                        "positive_data_acceptance",
                        "--no-color",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=False,
                )
        finally:
            engine.dispose()
    assert proc.returncode == 0, proc.stdout[-12000:] + proc.stderr[-3000:]
    assert "Tested: " in proc.stdout


def test_405_lists_every_method_of_the_resource(client: TestClient) -> None:
    resp = client.request("OPTIONS", "/api/v1/experiments")
    assert resp.status_code == 405
    assert resp.headers["content-type"].startswith("application/problem+json")
    assert set(resp.headers["allow"].split(", ")) == {"GET", "HEAD", "POST"}
    resp = client.put("/api/v1/schedules/abc")
    assert set(resp.headers["allow"].split(", ")) == {"GET", "HEAD", "PATCH", "DELETE"}


def test_numbers_are_not_dates_and_bools_are_not_ints(client: TestClient) -> None:
    resp = client.get("/api/v1/runs", params={"until": "0.5"})
    assert resp.status_code == 422
    assert resp.json()["errors"][0]["loc"] == ["query", "until"]
    resp = client.post("/api/v1/cluster/parity", json={"pipeline_parallel_size": True})
    assert resp.status_code == 422
    assert ["body", "pipeline_parallel_size"] in [e["loc"] for e in resp.json()["errors"]]


def test_every_operation_declares_its_problem_answers(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            responses = op["responses"]
            assert "500" in responses, (method, path)
            for code, response in responses.items():
                if code >= "400":
                    assert list(response["content"]) == ["application/problem+json"], (
                        method,
                        path,
                        code,
                    )
            if path.startswith("/api/"):
                assert {"401", "403", "503"} <= set(responses), (method, path)
