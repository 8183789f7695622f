"""Capacity searches and repeat numbers in the MLflow export (issue #26), round-tripped
through a real local MLflow store (SQLite, mlflow-skinny's ``SqlAlchemyStore``) and read
back with ``MlflowClient``: the search's settings as params, every search's evidence
(found, at least, below) as metrics and tags, and the repeats numbered from 1 as the
dashboard numbers them."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import delete, update
from sqlalchemy.orm import Session

from orchestrator.core.models import Experiment, Run, RunMetric
from orchestrator.integrations.mlflow_export import export_experiment
from orchestrator.integrations.mlflow_mapping import RunHead, capacity_tags, run_metrics
from tests.web.seed import CAPACITY_SLOS, DATA, capacity_runs, load_export

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # never report home from tests
from mlflow.tracking import MlflowClient  # noqa: E402

GOODPUT_SLOS = {"ttft_ms": 800.0, "tpot_ms": 60.0}


def _exported(client: MlflowClient, name: str) -> dict[str, Any]:
    exp = client.get_experiment_by_name(name)
    assert exp is not None
    return {r.data.tags["vlab.variant"]: r for r in client.search_runs([exp.experiment_id])}


def _one_sided(db_session: Session, name: str) -> dict[str, Any]:
    """:func:`capacity_runs` with ``apc-on``'s search below min (upper bound 1 req/s) and
    ``tp2``'s at least max (lower bound 8 req/s, the load generator's ceiling 9.5), their
    summary keeping no capacity (as the runner stores it), and goodput SLOs."""
    data = capacity_runs(db_session, name=name)
    docs = data["documents"]
    below = {**docs["apc-on"], "status": "below_min", "capacity": None, "interval": [None, 1.0],
             "binding_slo": "ttft_ms:p99", "note": "every load failed: below min"}  # fmt: skip
    at_least = {**docs["tp2"], "status": "at_least_max", "capacity": None,
                "interval": [8.0, None], "client_ceiling": 9.5, "note": None}  # fmt: skip
    for variant, doc in (("apc-on", below), ("tp2", at_least)):
        run_id = data["runs"][variant]
        db_session.execute(update(Run).where(Run.id == run_id).values(capacity=doc))
        db_session.execute(
            delete(RunMetric).where(RunMetric.run_id == run_id, RunMetric.name.like("capacity%"))
        )
    exp = db_session.get(Experiment, data["experiment_id"])
    assert exp is not None
    exp.spec = {**exp.spec, "slos": GOODPUT_SLOS}
    db_session.flush()
    db_session.expire_all()
    return data


def test_capacity_settings_and_one_sided_bounds_reach_mlflow(
    db_session: Session, tmp_path: Path
) -> None:
    name = f"capacity-mlflow-{uuid.uuid4().hex[:6]}"
    data = _one_sided(db_session, name)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    report = export_experiment(db_session, data["experiment_id"], uri)

    assert report.counts() == {"created": 3}
    runs = _exported(MlflowClient(tracking_uri=uri), name)
    assert set(runs) == {"baseline", "apc-on", "tp2"}
    for run in runs.values():
        params = run.data.params
        # the search's settings as submitted, and the defaults it ran with
        assert params["capacity.variable"] == "request_rate"
        assert (params["capacity.min"], params["capacity.max"]) == ("1.0", "8.0")
        assert params["capacity.tolerance"] == "0.05"
        assert params["capacity.max_steps"] == "12"
        assert params["capacity.requests_per_step"] == "64"
        assert params["capacity.confidence"] == "0.95"
        assert params["capacity.remeasure"] == "1"
        for metric, objectives in CAPACITY_SLOS.items():
            for pct, ms in objectives.items():
                assert params[f"capacity.slos.{metric}.{pct}"] == str(ms)
        for default in ("min_step_s", "max_step_s", "step_time_factor", "warmup_fraction"):
            assert f"capacity.{default}" in params, default  # step lengths
        assert "capacity.goodput" not in params  # not set: absent, not "null"
        assert params["slos.ttft_ms"] == "800.0" and params["slos.tpot_ms"] == "60.0"
        assert run.data.tags["vlab.capacity_variable"] == "request_rate"
        assert run.data.tags["vlab.capacity_steps"] == str(
            len(data["documents"][run.data.tags["vlab.variant"]]["steps"])
        )

    found = runs["baseline"]
    assert found.data.tags["vlab.capacity_status"] == "found"
    assert found.data.tags["vlab.capacity_bound"] == "found: 2.1 req/s (bracket 2.1 to 2.2)"
    assert found.data.tags["vlab.capacity_binding_slo"] == "ttft_ms:p99"
    m = found.data.metrics
    assert (m["capacity"], m["capacity_low"], m["capacity_high"]) == (2.1, 2.1, 2.2)
    assert (m["capacity_lower_bound"], m["capacity_upper_bound"]) == (2.1, 2.2)
    assert "capacity" not in found.data.tags.get("vlab.unknown_metrics", "").split(", ")

    below = runs["apc-on"]
    assert below.data.tags["vlab.capacity_status"] == "below_min"
    assert below.data.tags["vlab.capacity_bound"] == "below_min: below 1 req/s"
    assert below.data.tags["vlab.capacity_note"] == "every load failed: below min"
    assert below.data.metrics["capacity_upper_bound"] == 1.0
    assert not {"capacity", "capacity_lower_bound", "capacity_low"} & set(below.data.metrics)
    assert "capacity" in below.data.tags["vlab.unknown_metrics"].split(", ")

    at_least = runs["tp2"]
    assert at_least.data.tags["vlab.capacity_status"] == "at_least_max"
    assert at_least.data.tags["vlab.capacity_bound"] == "at_least_max: at least 8 req/s"
    assert at_least.data.metrics["capacity_lower_bound"] == 8.0
    assert at_least.data.metrics["capacity_client_ceiling"] == 9.5
    assert not {"capacity", "capacity_upper_bound"} & set(at_least.data.metrics)
    assert "capacity" in at_least.data.tags["vlab.unknown_metrics"].split(", ")
    assert "vlab.capacity_binding_slo" not in at_least.data.tags  # none: absent


def test_a_failed_search_run_keeps_its_status_but_no_bound(db_session: Session) -> None:
    data = capacity_runs(db_session, name=f"capacity-failed-{uuid.uuid4().hex[:6]}")
    run = db_session.get(Run, data["runs"]["baseline"])
    assert run is not None
    run.status = "failed"
    head = RunHead.of(run)
    stored = {"capacity": 2.1, "capacity_low": 2.1, "capacity_high": 2.2}
    assert run_metrics(head, stored) == ({}, [])  # a cut-short search: no number at all
    assert capacity_tags(head)["vlab.capacity_status"] == "found"
    plain = load_export(db_session, DATA / "demo_experiment.json", name="no-capacity")
    demo = db_session.get(Run, next(iter(plain["runs"].values())))
    assert demo is not None
    assert capacity_tags(RunHead.of(demo)) == {}
    # no search: no capacity bound, nothing named unknown for it
    metrics, unknown = run_metrics(RunHead.of(demo), {"output_throughput": 205.0})
    assert metrics == {"output_throughput": 205.0} and "capacity" not in unknown


def test_repeats_are_numbered_from_1_as_on_the_dashboard(
    db_session: Session, tmp_path: Path
) -> None:
    name = f"repeats-{uuid.uuid4().hex[:6]}"
    ids = load_export(db_session, DATA / "demo_experiment.json", name=name)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    export_experiment(db_session, ids["experiment_id"], uri)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(name)
    assert exp is not None
    tags = [r.data.tags for r in client.search_runs([exp.experiment_id])]
    got = {(t["mlflow.runName"], t["vlab.repeat"], t["vlab.repeat_index"]) for t in tags}
    # the dashboard's "baseline #1", "#2" (run page heading, ladder links); the raw index kept
    assert got == {
        ("baseline #1", "1", "0"),
        ("baseline #2", "2", "1"),
        ("apc-on #1", "1", "0"),
        ("apc-on #2", "2", "1"),
    }
