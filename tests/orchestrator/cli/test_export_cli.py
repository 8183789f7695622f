"""``vlab export mlflow``: through the API (the service exports; the CLI never opens the
database) to a real local MLflow store (SQLite, which the test service allows), read back
with MLflow's ``MlflowClient``; one-line errors."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.schemas import CampaignMlflowExportOut
from orchestrator.cli import export as cli_export
from orchestrator.core.db import unit_of_work
from orchestrator.core.models import Campaign
from orchestrator.integrations.mlflow_campaign import CampaignExportReport
from orchestrator.integrations.mlflow_export import ExportReport, RunExport
from tests.orchestrator.cli.conftest import cli
from tests.web.seed import DATA, load_export

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # never report home from tests
pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


def test_cli_exports_and_re_exports(
    api: TestClient, factory: sessionmaker[Session], tmp_path: Path
) -> None:
    name = f"cli-mlflow-{uuid.uuid4().hex[:8]}"
    with unit_of_work(factory) as session:
        exp_id = str(
            load_export(session, DATA / "demo_experiment.json", name=name)["experiment_id"]
        )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    result = cli("export", "mlflow", exp_id, "--tracking-uri", uri)
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

    again = cli("export", "mlflow", exp_id, "--tracking-uri", uri, "--max-points", "2")
    assert again.exit_code == 0, again.output
    assert "4 unchanged" in again.output
    replaced = cli(
        "export", "mlflow", exp_id, "--tracking-uri", uri, "--replace", "--max-points", "2"
    )
    assert replaced.exit_code == 0, replaced.output
    assert "4 replaced" in replaced.output
    run = ml.search_runs([exp.experiment_id])[0]
    # --max-points 2: two "during" points, plus the "before" and "after" samples
    assert len(ml.get_metric_history(run.info.run_id, "series/kv_cache_usage")) == 4


def test_cli_errors_are_one_line(
    api: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    result = cli("export", "mlflow", "nope")  # neither given nor configured in the service
    assert result.exit_code == 2, result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.strip()]
    assert line.startswith("error:") and "(422)" in line and "tracking_uri" in line
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = cli("export", "mlflow", "no-such-id", "--tracking-uri", uri)
    assert result.exit_code == 2
    (line,) = [ln for ln in result.output.splitlines() if ln.strip()]
    assert "(404)" in line and "no-such-id" in line
    assert "Traceback" not in result.output


@pytest.mark.parametrize("uri", ["file:///tmp/x", "not a uri", "ftp://x/y"])
def test_cli_refuses_a_uri_mlflow_cannot_take_in_one_line(
    api: TestClient, uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    result = cli("export", "mlflow", "some-id", "--tracking-uri", uri)
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "sqlite:///" in lines[0]
    if uri.startswith("file:"):
        assert "MLFLOW_ALLOW_FILE_STORE=true" in lines[0]


def test_cli_exports_a_campaign_as_a_parent_run(
    api: TestClient,
    factory: sessionmaker[Session],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # a SQLite store keeps artifacts under the working directory
    gain = {"estimate": 0.26, "low": 0.2, "high": 0.3, "se": 0.02, "df": 3.0, "n": 4}
    with unit_of_work(factory) as session:
        row = Campaign(
            name=f"cli-campaign-{uuid.uuid4().hex[:8]}",
            status="succeeded",
            request={"model": "tiny", "objective": {"metric": "output_throughput"}},
            result={
                "phase": "done",
                "runs_used": 12,
                "start": {"engine_args.enable_prefix_caching": False},
                "incumbent": {"engine_args.enable_prefix_caching": True},
                "path": [
                    {
                        "round": 1,
                        "variable": "engine_args.enable_prefix_caching",
                        "from_level": False,
                        "to_level": True,
                        "gain": {**gain, "confidence": 0.95},
                        "effect": "+30 %",
                    }
                ],
                "cumulative": {**gain, "confidence": 0.95},
            },
        )
        session.add(row)
        session.flush()
        cid = row.id
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = cli("export", "mlflow-campaign", cid, "--tracking-uri", uri)
    assert result.exit_code == 0, result.output
    assert f"campaign {cid}: parent MLflow run" in result.output and "(created;" in result.output
    ml = MlflowClient(tracking_uri=uri)
    (parent,) = ml.search_runs([ml.get_experiment_by_name(row.name).experiment_id])
    assert parent.data.params["final.engine_args.enable_prefix_caching"] == "true"
    assert parent.data.metrics["cumulative_gain"] == 0.26
    missing = cli("export", "mlflow-campaign", "nope", "--tracking-uri", uri)
    assert missing.exit_code == 2 and "nope" in missing.output and "(404)" in missing.output
    assert "Traceback" not in missing.output


def test_a_campaign_export_is_one_table_with_a_cycle_column_and_one_total() -> None:
    """A campaign of two cycles prints the parent, one table (cycle 1 and 2) and one line
    of totals over both, not a table and a totals line per cycle."""

    def cycle(experiment: str, actions: list[str]) -> ExportReport:
        runs = [
            RunExport(f"{experiment}-r{i}", "baseline", i, "succeeded", a, f"ml-{experiment}-{i}")  # type: ignore[arg-type]
            for i, a in enumerate(actions)
        ]
        return ExportReport(experiment, "sqlite:///x.db", "tune", "7", runs)

    report = CampaignExportReport(
        "c1",
        "sqlite:///x.db",
        "tune",
        "7",
        parent_run_id="p1",
        nested=3,
        cycles=[cycle("e1", ["created", "created"]), cycle("e2", ["unchanged"])],
    )
    with cli_export.console.capture() as captured:  # the API's shape of the report
        cli_export.print_campaign_report(
            CampaignMlflowExportOut.model_validate(report.as_dict()).model_dump(mode="json")
        )
    out = captured.get()
    assert out.count("MLflow experiment 'tune'") == 1
    assert "2 created, 1 unchanged" in out
    assert out.count("ml-e1-") == 2 and "ml-e2-0" in out
    assert "cycle" in out
