"""``vlab export mlflow``: straight from the database to a real local MLflow store (SQLite),
read back with MLflow's ``MlflowClient``; any URI on the command line, one-line errors."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from orchestrator.cli.main import app
from orchestrator.core.db import unit_of_work
from orchestrator.core.settings import get_settings
from tests.web.seed import DATA, load_export

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # never report home from tests
pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


@pytest.fixture
def cli_env(database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CLI's settings point at the test database (read once per process: cache cleared)."""
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.setenv("VLAB_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_cli_exports_and_re_exports(
    cli_env: None, session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    name = f"cli-mlflow-{uuid.uuid4().hex[:8]}"
    with unit_of_work(session_factory) as session:
        exp_id = str(
            load_export(session, DATA / "demo_experiment.json", name=name)["experiment_id"]
        )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    result = CliRunner().invoke(app, ["export", "mlflow", exp_id, "--tracking-uri", uri])
    assert result.exit_code == 0, result.output
    assert "4 created" in result.output and name in result.output
    ml = MlflowClient(tracking_uri=uri)
    exp = ml.get_experiment_by_name(name)
    assert exp is not None
    runs = ml.search_runs([exp.experiment_id])
    assert sorted(r.data.tags["vlab.variant"] for r in runs) == [
        "apc-on",
        "apc-on",
        "baseline",
        "baseline",
    ]

    again = CliRunner().invoke(
        app, ["export", "mlflow", exp_id, "--tracking-uri", uri, "--max-points", "2"]
    )
    assert again.exit_code == 0, again.output
    assert "4 unchanged" in again.output
    replaced = CliRunner().invoke(
        app,
        ["export", "mlflow", exp_id, "--tracking-uri", uri, "--replace", "--max-points", "2"],
    )
    assert replaced.exit_code == 0, replaced.output
    assert "4 replaced" in replaced.output
    run = ml.search_runs([exp.experiment_id])[0]
    # --max-points 2: two "during" points, plus the "before" and "after" samples
    assert len(ml.get_metric_history(run.info.run_id, "series/kv_cache_usage")) == 4


def test_cli_errors_are_one_line(cli_env: None, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["export", "mlflow", "nope"])
    assert result.exit_code == 2
    assert "no tracking URI" in result.output
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = CliRunner().invoke(app, ["export", "mlflow", "no-such-id", "--tracking-uri", uri])
    assert result.exit_code == 2
    assert "no experiment no-such-id" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("uri", ["file:///tmp/x", "not a uri", "ftp://x/y"])
def test_cli_refuses_a_uri_mlflow_cannot_take_in_one_line(
    cli_env: None, uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    result = CliRunner().invoke(app, ["export", "mlflow", "some-id", "--tracking-uri", uri])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "sqlite:///" in lines[0]
    if uri.startswith("file:"):
        assert "MLFLOW_ALLOW_FILE_STORE=true" in lines[0]
