"""Campaign cycles side by side (orchestrator.tuning.measuring_slots, .cycles) against a real
Postgres: the slots a campaign takes from the cluster and keeps, and the runs of a cycle
stored as the dispatcher batches them (each configuration's pairs in a row, one server).

The cluster is a **stand-in** (``ClusterView.read`` replaced): a GPU cluster with devices
cannot exist here; the runs' results are the fake recorded results of
``test_campaign_service``.
"""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.db import unit_of_work
from orchestrator.core.models import Campaign
from orchestrator.core.repositories import CampaignRepository, RunRepository
from orchestrator.core.settings import Settings
from orchestrator.experiments.cluster_view import ClusterView
from orchestrator.tuning import measuring_slots
from orchestrator.tuning.campaign_request import CampaignRequest
from tests.api.conftest import settings as settings  # noqa: F401 - fixture
from tests.orchestrator.tuning.test_campaign_service import (  # noqa: F401 - fixtures
    campaign_doc,
    create,
    database,
    drive,
    factory,
    step,
)


def _cluster(monkeypatch: pytest.MonkeyPatch, view: ClusterView) -> None:
    monkeypatch.setattr(measuring_slots.ClusterView, "read", classmethod(lambda cls, s, st: view))


def _concurrent(settings: Settings, n: int) -> Settings:  # noqa: F811
    return settings.model_copy(
        update={"orchestrator": settings.orchestrator.model_copy(update={"max_concurrent_runs": n})}
    )


@pytest.mark.parametrize(
    ("view", "concurrent", "space", "slots"),
    [
        (ClusterView(devices=8, kind="GPU"), 4, None, 4),  # the dispatcher's limit
        (ClusterView(devices=8, kind="GPU"), 16, None, 8),  # the devices
        (ClusterView(devices=8, kind="GPU"), 16, [1, 2, 4], 2),  # TP up to 4: 2 at once
        (ClusterView(devices=8, kind="CPU"), 16, None, 1),  # CPU hosts: interleaved
        (ClusterView(), 16, None, 1),  # unknown cluster
        (ClusterView(devices=8, kind="GPU"), 1, None, 1),  # one run at a time
    ],
)
def test_slots_are_the_runs_the_dispatcher_and_the_devices_hold_at_once(
    monkeypatch: pytest.MonkeyPatch,
    settings: Settings,  # noqa: F811
    view: ClusterView,
    concurrent: int,
    space: list[int] | None,
    slots: int,
) -> None:
    doc = campaign_doc()
    if space is not None:
        doc["space"] = [*doc["space"], {"name": "layout.tensor_parallel_size", "levels": space}]
        doc["baseline"]["layout"] = {"tensor_parallel_size": 1}
    request = CampaignRequest.model_validate(doc)
    _cluster(monkeypatch, view)
    row = Campaign(name="x", request=doc, result={})
    got = measuring_slots.campaign_slots(
        None, _concurrent(settings, concurrent), row, request, False
    )  # type: ignore[arg-type]
    assert got == slots
    # kept once stored; a campaign that queued runs before slots were kept stays at 1
    row.result = {"slots": 3}
    assert measuring_slots.campaign_slots(None, settings, row, request, True) == 3  # type: ignore[arg-type]
    row.result = {}
    assert measuring_slots.campaign_slots(None, settings, row, request, True) == 1  # type: ignore[arg-type]


def test_a_side_by_side_cycle_is_stored_as_server_mates_and_the_slots_are_kept(
    monkeypatch: pytest.MonkeyPatch,
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
) -> None:
    """On a GPU cluster of 8 devices with a dispatcher that runs 8 at once: the first
    cycle is ``min_repeats`` (2) pairs of its 4 configurations, stored as one experiment
    with 2 repeats whose runs execute each configuration's pairs in a row, so the
    dispatcher claims both runs of a configuration as one batch (one vLLM server). The
    slots are kept: when the cluster is gone the campaign goes on planning as it began,
    and it ends with prefix caching adopted and confirmed in one side-by-side cycle."""
    wide = _concurrent(settings, 8)
    _cluster(monkeypatch, ClusterView(devices=8, kind="GPU"))
    cid = create(factory, wide)
    row = step(factory, wide, cid)
    assert row.result["slots"] == 8
    with factory() as s:
        runs = sorted(CampaignRepository(s).runs(cid), key=lambda r: r.sequence)
        assert len({r.experiment_id for r in runs}) == 1
        labels = [r.campaign_label for r in runs]
        assert labels[:3] == [
            "r1.c1.incumbent",
            "r1.c2.incumbent",
            "r1.c1.engine_args.enable_prefix_caching=true",
        ]
        keys = [r.server_key for r in runs]
        assert keys == sorted(keys, key=keys.index)  # each configuration's runs in a row
    with unit_of_work(factory) as s:
        repo = RunRepository(s)
        first = repo.claim_next_queued("o1")
        assert first is not None and first.campaign_label == "r1.c1.incumbent"
        mates = repo.claim_server_mates(first, "o1")
        assert [m.campaign_label for m in mates] == ["r1.c2.incumbent"]
        for run in (first, *mates):  # back to queued: the fake results take them from there
            run.status, run.claimed_by, run.claimed_at = "queued", None, None
    _cluster(monkeypatch, ClusterView())  # the cluster is gone: the kept slots still hold
    row = drive(factory, settings, cid)
    assert row.status == "succeeded", row.status_reason
    assert row.result["slots"] == 8
    assert [s["variable"] for s in row.result["path"]] == ["engine_args.enable_prefix_caching"]
    confirm = sorted(label for label in row.result["runs"] if label.startswith("confirm."))
    assert len(confirm) == 2 * 3  # max_repeats pairs, all in one cycle
    with factory() as s:
        experiments = {
            r.experiment_id
            for r in CampaignRepository(s).runs(cid)
            if str(r.campaign_label).startswith("confirm.")
        }
        assert len(experiments) == 1
