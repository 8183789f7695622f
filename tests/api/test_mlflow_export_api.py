"""``POST /api/v1/experiments/{id}/export/mlflow`` against a real Postgres and a real local
MLflow store (SQLite), read back with MLflow's ``MlflowClient``; every refusal is
problem+json with a stable code."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.db import unit_of_work
from orchestrator.core.settings import Settings
from tests.web.seed import DATA, load_export

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # never report home from tests
pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

PROBLEM = "application/problem+json"


@pytest.fixture
def demo_id(session_factory: sessionmaker[Session]) -> str:
    """The real demo experiment (vLLM 0.32.0 CPU, APC off vs on, 2 repeats), committed."""
    with unit_of_work(session_factory) as session:
        ids = load_export(
            session, DATA / "demo_experiment.json", name=f"api-mlflow-{uuid.uuid4().hex[:8]}"
        )
    return str(ids["experiment_id"])


def test_export_to_a_local_store_when_allowed(
    client: TestClient, settings: Settings, demo_id: str, tmp_path: Path
) -> None:
    settings.mlflow.allow_local_stores = True
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    resp = client.post(
        f"/api/v1/experiments/{demo_id}/export/mlflow",
        json={"tracking_uri": uri, "experiment_name": "from-the-api"},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["counts"] == {"created": 4}
    assert body["mlflow_experiment_name"] == "from-the-api"
    assert {r["action"] for r in body["runs"]} == {"created"}
    assert all(r["series_points"] > 0 and r["metrics"] > 0 for r in body["runs"])
    assert "request_goodput" in body["runs"][0]["unknown_metrics"]

    ml = MlflowClient(tracking_uri=uri)
    exp = ml.get_experiment_by_name("from-the-api")
    assert exp is not None
    runs = ml.search_runs([exp.experiment_id])
    assert len(runs) == 4
    run = runs[0]
    assert run.data.tags["vlab.experiment_id"] == demo_id
    # the run's page on the dashboard, at the address the caller used
    assert run.data.tags["vlab.run_url"] == (
        f"http://testserver/runs/{run.data.tags['vlab.run_id']}"
    )

    again = client.post(
        f"/api/v1/experiments/{demo_id}/export/mlflow",
        json={"tracking_uri": uri, "experiment_name": "from-the-api"},
    )
    assert again.status_code == 200 and again.json()["counts"] == {"unchanged": 4}
    assert len(ml.search_runs([exp.experiment_id])) == 4


def test_refusals_are_problems_with_stable_codes(
    client: TestClient, demo_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"/api/v1/experiments/{demo_id}/export/mlflow"
    target = tmp_path / "target"
    target.mkdir()
    # the API writes nothing on the service's own disk unless an administrator allows it
    for uri in (f"file://{target}/mlruns", f"sqlite:///{target}/m.db", str(target)):
        resp = client.post(url, json={"tracking_uri": uri})
        assert resp.status_code == 422, resp.text
        assert resp.headers["content-type"].startswith(PROBLEM)
        assert resp.json()["code"] == "export_request_invalid"
        assert resp.json()["errors"][0]["loc"] == ["body", "tracking_uri"]
    assert not list(target.iterdir())
    resp = client.post(url, json={})
    assert resp.status_code == 422 and resp.json()["errors"][0]["type"] == "missing"
    resp = client.post(url, json={"tracking_uri": "https://x.example", "replace": 1})
    assert resp.status_code == 422 and resp.json()["code"] == "request_invalid"

    resp = client.post(
        "/api/v1/experiments/no-such-experiment/export/mlflow",
        json={"tracking_uri": "http://127.0.0.1:9"},
    )
    assert resp.status_code == 404 and resp.json()["code"] == "experiment_not_found"

    # nothing listens on the loopback's discard port: 502 at once, not MLflow's minutes of retries
    resp = client.post(url, json={"tracking_uri": "http://127.0.0.1:9"})
    assert resp.status_code == 502, resp.text
    assert resp.headers["content-type"].startswith(PROBLEM)
    assert resp.json()["code"] == "mlflow_unreachable"

    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    resp = client.post(url, json={"tracking_uri": "http://127.0.0.1:9"})
    assert resp.status_code == 501
    assert resp.json()["code"] == "mlflow_not_installed"


MARKER = "vlab-secret-marker-7f3a"


class _NotMlflow(http.server.BaseHTTPRequestHandler):
    """Any http service: a JSON problem (or an HTML page) quoting a secret, to every request."""

    def _answer(self) -> None:
        if "html" in self.path or self.server.html:  # type: ignore[attr-defined]
            body, kind = f"<html>{MARKER}</html>".encode(), "text/html"
        else:
            problem = {"type": "about:blank", "instance": self.path, "x": MARKER}
            body, kind = json.dumps(problem).encode(), "application/problem+json"
        self.send_response(404)
        self.send_header("Content-Type", kind)
        self.send_header("X-Secret", MARKER)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("html", [False, True])
def test_a_server_that_is_no_mlflow_server_is_not_quoted(
    client: TestClient, demo_id: str, html: bool
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotMlflow)
    server.html = html  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        resp = client.post(
            f"/api/v1/experiments/{demo_id}/export/mlflow", json={"tracking_uri": uri}
        )
    finally:
        server.shutdown()
        server.server_close()
    assert resp.status_code == 502, resp.text
    assert resp.json()["code"] == "mlflow_error"
    assert MARKER not in resp.text and "/api/2.0/mlflow" not in resp.text
    assert MARKER not in str(resp.headers)
    assert "is it an MLflow tracking server?" in resp.json()["detail"]
    if html:
        assert "HTTP 404" in resp.json()["detail"]


def test_a_bad_request_body_is_not_called_a_spec(client: TestClient, demo_id: str) -> None:
    resp = client.post(
        f"/api/v1/experiments/{demo_id}/export/mlflow", json={"tracking_uri": "ftp://x/y"}
    )
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert detail.startswith("1 problem(s) in the request: body.tracking_uri"), detail
    assert "spec" not in detail


def test_openapi_declares_the_export_answers(client: TestClient) -> None:
    op = client.get("/openapi.json").json()["paths"][
        "/api/v1/experiments/{experiment_id}/export/mlflow"
    ]["post"]
    assert {"200", "404", "409", "422", "501", "502"} <= set(op["responses"])
    for code in ("409", "501", "502"):
        assert list(op["responses"][code]["content"]) == [PROBLEM]


def test_the_api_process_does_not_load_mlflow() -> None:
    """mlflow (about a second to import) loads only when an export runs."""
    code = "import sys, api.app; print(any(m.split('.')[0] == 'mlflow' for m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
