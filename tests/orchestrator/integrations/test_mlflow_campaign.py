"""A tuning campaign exported to a real local MLflow store (SQLite, mlflow-skinny's own
store) and read back with MLflow's ``MlflowClient``: the parent run (params, metrics with
the step gains as a history, verdict tags, the path artifact) and its runs nested.

The campaign is advanced by the service with **fake recorded results** (the objective as
the run's stored metric, from a known surface: prefix caching pays, ``max_num_seqs`` 64 is
worse); a fresh database per module.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.db import unit_of_work
from orchestrator.core.errors import NotFoundError
from orchestrator.core.models import Campaign, Run
from orchestrator.core.repositories import CampaignRepository, RunRepository
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus
from orchestrator.dispatch.lost_runs import fail_lost
from orchestrator.integrations.mlflow_campaign import PATH_ARTIFACT, export_campaign
from orchestrator.tuning.intake import accept_campaign
from tests.api.conftest import settings as settings  # noqa: F401 - fixture
from tests.orchestrator.tuning.test_campaign_service import (
    campaign_doc,
    drive,
    record_fake_result,
    surface,
)

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # never report home from tests
mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


@pytest.fixture
def ended(factory: sessionmaker[Session], settings: Settings) -> Campaign:  # noqa: F811
    with unit_of_work(factory) as s:
        cid = accept_campaign(s, settings, campaign_doc(name="tune apc export")).id
    row = drive(factory, settings, cid)
    assert row.status == "succeeded", row.status_reason
    return row


def test_a_campaign_exports_as_a_parent_run_with_its_runs_nested(
    factory: sessionmaker[Session],
    ended: Campaign,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # a SQLite store keeps artifacts under the working directory
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with factory() as s:
        report = export_campaign(s, ended.id, uri, base_url="http://vlab.example")
        n_runs = len(CampaignRepository(s).runs(ended.id))
    assert report.parent_action == "created" and report.nested == n_runs
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(report.parent_run_id)
    p, tags = parent.data.params, parent.data.tags
    assert p["objective.metric"] == "output_throughput" and p["objective.direction"] == "higher"
    assert json.loads(p["space"])[0]["name"] == "engine_args.enable_prefix_caching"
    assert p["final.engine_args.enable_prefix_caching"] == "true"
    assert p["start.engine_args.enable_prefix_caching"] == "false"
    assert p["rule.max_repeats"] == "3" and p["serve_command"].startswith("vllm serve tiny")
    assert parent.info.status == "FINISHED" and tags["vlab.kind"] == "campaign"
    assert tags["vlab.campaign_url"] == f"http://vlab.example/campaigns/{ended.id}"
    assert tags["vlab.verdict.r1.engine_args.enable_prefix_caching:true"] == "adopted"
    assert tags["vlab.verdict.r1.engine_args.max_num_seqs:64"] == "worse"
    assert tags["vlab.path"].startswith("engine_args.enable_prefix_caching: false -> true")
    # the cumulative gain and its interval; each adopted step's gain as a history
    cumulative = ended.result["cumulative"]
    m = parent.data.metrics
    assert math.isclose(m["cumulative_gain"], cumulative["estimate"])
    assert m["cumulative_gain_low"] < m["cumulative_gain"] < m["cumulative_gain_high"]
    assert math.isclose(m["cumulative_gain_relative"], math.expm1(cumulative["estimate"]))
    history = client.get_metric_history(report.parent_run_id, "step_gain")
    assert [h.step for h in history] == list(range(1, len(ended.result["path"]) + 1))
    assert math.isclose(history[0].value, ended.result["path"][0]["gain"]["estimate"])
    # the path as a JSON artifact
    local = client.download_artifacts(report.parent_run_id, PATH_ARTIFACT, str(tmp_path))
    doc = json.loads(Path(local).read_text())
    assert doc["path"][0]["variable"] == "engine_args.enable_prefix_caching"
    assert doc["incumbent"] == ended.result["incumbent"] and doc["candidates"]
    # every run of the campaign nested under the parent, with its label
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{report.parent_run_id}'",
        max_results=1000,
    )
    assert len(children) == n_runs
    assert all(c.data.tags["vlab.campaign_id"] == ended.id for c in children)
    assert {c.data.tags["vlab.campaign_label"] for c in children} == set(ended.result["runs"])
    assert all("output_throughput" in c.data.metrics for c in children)
    # again: nothing new; the parent and the runs are left as they are
    with factory() as s:
        again = export_campaign(s, ended.id, uri)
    assert again.parent_action == "unchanged" and again.parent_run_id == report.parent_run_id
    assert {r.action for c in again.cycles for r in c.runs} == {"unchanged"}
    found = client.search_runs([parent.info.experiment_id], max_results=1000)
    assert len(found) == n_runs + 1


def test_an_unknown_campaign_is_not_found(factory: sessionmaker[Session], tmp_path: Path) -> None:
    with factory() as s, pytest.raises(NotFoundError):
        export_campaign(s, "no-such-campaign", f"sqlite:///{tmp_path / 'm.db'}")


#: The runs of the campaign with retries: one lost to the infrastructure, one whose
#: objective a finding flags (a warm prefix cache); each is measured again once.
LOST, FLAGGED = "r1.c1.engine_args.max_num_seqs=256", "r1.c1.engine_args.max_num_seqs=64"


def _lose_or_flag(s: Session, run: Run) -> None:
    """A fake result: :data:`LOST` lost the way the dispatcher ends it, :data:`FLAGGED`
    measured on a warm prefix cache, the others their surface's value."""
    repo = RunRepository(s)
    if run.campaign_label == LOST:
        repo.transition(run, RunStatus.PREPARING)
        fail_lost(repo, run, "orchestrator restarted and the run's supervisor is gone")
        return
    record_fake_result(s, run, surface(run))
    if run.campaign_label == FLAGGED:
        run.engine_info = {"cache_contamination": {"status": "contaminated"}}


def test_a_run_measured_again_exports_by_its_label_and_variant_not_as_baseline(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A candidate measured again runs alone, as its own experiment's baseline: its MLflow
    run is named by its campaign label, carries its candidate's variant as the run it
    measures again did, and says which run that was and why (lost, or flagged)."""
    with unit_of_work(factory) as s:
        cid = accept_campaign(s, settings, campaign_doc(name="tune apc retries")).id
    row = drive(factory, settings, cid, _lose_or_flag)
    assert row.result["retried"] == {LOST: f"{LOST}.retry1", FLAGGED: f"{FLAGGED}.retry1"}
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with factory() as s:
        report = export_campaign(s, cid, uri)
        variants = {r.campaign_label: r.name for r in CampaignRepository(s).runs(cid)}
    client = MlflowClient(tracking_uri=uri)
    children = {
        c.data.tags["vlab.campaign_label"]: c
        for c in client.search_runs(
            [client.get_run(report.parent_run_id).info.experiment_id],
            filter_string=f"tags.`mlflow.parentRunId` = '{report.parent_run_id}'",
            max_results=1000,
        )
    }
    for first, why in (
        (LOST, "lost to the infrastructure: orchestrator restarted"),
        (FLAGGED, "a finding flagged its objective: warm_cache: measured on a warm prefix"),
    ):
        retry = children[f"{first}.retry1"]
        tags = retry.data.tags
        assert variants[f"{first}.retry1"] == "baseline"  # its own experiment's baseline
        assert retry.info.run_name == f"{first}.retry1"
        assert tags["vlab.variant"] == variants[first] == first.split(".", 2)[2]
        assert tags["vlab.variant"] == children[first].data.tags["vlab.variant"]
        assert tags["vlab.is_baseline"] == "false"
        assert tags["vlab.retry_of"] == first
        assert tags["vlab.retry_reason"].startswith(why), tags["vlab.retry_reason"]
    # a run not measured again keeps its name: its variant and repeat
    assert children["r1.c1.incumbent"].info.run_name == "baseline #1"  # numbered from 1
    assert "vlab.retry_of" not in children["r1.c1.incumbent"].data.tags
