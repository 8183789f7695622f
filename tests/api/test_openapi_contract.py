"""The OpenAPI description tells the truth: schemathesis against the real app and database.

``st run --checks all`` (schemathesis) drives every operation of ``/openapi.json`` over
real HTTP (uvicorn in a thread) with generated valid and invalid requests, in a bounded
number of examples and a fixed seed, on a database holding the demo experiment as a real
run left it (its ids are the path parameters: ``tests/api/schemathesis.toml``), and checks:
no 5xx, every status code and content type declared (problem+json, CSV, Parquet, the
engine log's text), response bodies and headers as declared, invalid requests refused,
schema-valid requests accepted, 405 with ``Allow``, authentication enforced. Where the
API refuses a schema-valid request for a reason JSON Schema cannot state (a rule across
fields, a model that must resolve, a cron expression that must parse), the config names
the operation and the rule, and the refusal is its declared 422 problem+json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from jobs.signals.engineevents import EVENT_TYPES
from orchestrator.core import auth
from orchestrator.core.db import normalize_url, unit_of_work, upgrade_to_head
from orchestrator.core.settings import EngineSettings, Settings
from orchestrator.runs.history import SORT_KEYS
from tests.api.livehttp import live_server
from tests.conftest import fresh_database
from tests.factories import DATA
from tests.web.seed import load_export

ST = Path(sys.executable).with_name("st")
ST_CONFIG = Path(__file__).with_name("schemathesis.toml")
DEMO = Path(__file__).resolve().parents[1] / "web" / "data" / "demo_experiment.json"


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
            demo = load_export(session, DEMO)
        env = {
            **os.environ,
            "VLAB_CONTRACT_EXPERIMENT_ID": demo["experiment_id"],
            "VLAB_CONTRACT_RUN_ID": next(iter(demo["runs"].values())),
        }
        try:
            with live_server(create_app(settings, factory)) as base:
                proc = subprocess.run(
                    [
                        str(ST if ST.exists() else shutil.which("st")),
                        "--config-file",
                        str(ST_CONFIG),
                        "run",
                        f"{base}/openapi.json",
                        "-H",
                        f"Authorization: Bearer {token}",
                        "--checks",
                        "all",
                        "--max-examples",
                        "12",
                        "--seed",
                        "20261201",
                        "--no-color",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=False,
                    env=env,
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


def test_enumerated_query_parameters_are_enums_in_the_schema(client: TestClient) -> None:
    """A parameter the API checks against a fixed set says so (``enum``), from the same
    vocabulary the code checks: the history's sort keys and the engine event types."""
    doc = client.get("/openapi.json").json()

    def enum(path: str, name: str) -> list[str]:
        (param,) = [p for p in doc["paths"][path]["get"]["parameters"] if p["name"] == name]
        schema = param["schema"]
        (values,) = [s["enum"] for s in schema.get("anyOf", [schema]) if "enum" in s]
        return list(values)

    assert enum("/api/v1/runs", "sort") == list(SORT_KEYS)
    assert enum("/api/v1/runs", "order") == ["asc", "desc"]
    assert enum("/api/v1/runs/{run_id}/events", "type") == list(EVENT_TYPES)
    assert enum("/api/v1/runs/{run_id}/events", "placement") == ["placed", "unplaced"]
    assert enum("/api/v1/experiments/{experiment_id}/export", "format") == ["csv", "parquet"]
    bad = client.get("/api/v1/runs/x/events", params={"type": "nope"})
    assert bad.status_code == 422 and bad.json()["errors"][0]["loc"] == ["query", "type"]


def test_every_success_media_type_is_declared(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    """Each success answer's media type is in the operation's declared responses: the CSV
    and Parquet exports, the engine log as text, JSON elsewhere."""
    doc = client.get("/openapi.json").json()
    with unit_of_work(session_factory) as session:
        demo = load_export(session, DEMO)
    exp, run = demo["experiment_id"], next(iter(demo["runs"].values()))
    export = "/api/v1/experiments/{experiment_id}/export"
    declared = doc["paths"][export]["get"]["responses"]["200"]["content"]
    assert set(declared) == {"text/csv", "application/vnd.apache.parquet"}
    for fmt, media in (("csv", "text/csv"), ("parquet", "application/vnd.apache.parquet")):
        resp = client.get(f"/api/v1/experiments/{exp}/export", params={"format": fmt})
        assert resp.status_code == 200
        assert resp.headers["content-type"].split(";")[0] == media
        assert f'filename="{exp}.{fmt}"' in resp.headers["content-disposition"]
    assert resp.content[:4] == b"PAR1"  # a Parquet file
    log = client.get(f"/api/v1/runs/{run}/log")
    log_doc = doc["paths"]["/api/v1/runs/{run_id}/log"]["get"]["responses"]["200"]
    assert log.status_code == 200 and log.headers["content-type"].startswith("text/plain")
    assert list(log_doc["content"]) == ["text/plain"]
    assert int(log.headers["x-noise-lines-dropped"]) >= 0
    assert "X-Noise-Lines-Dropped" in log_doc["headers"]
    for path, item in doc["paths"].items():  # the rest answer JSON (or nothing: 204)
        for method, op in item.items():
            for code, response in op["responses"].items():
                if code < "300" and path not in (export, "/api/v1/runs/{run_id}/log"):
                    assert list(response.get("content", {})) in (
                        ["application/json"],
                        [],
                    ), (method, path, code)
