"""The campaign service orders each round's candidates by evidence
(orchestrator.tuning.evidence) against a real Postgres: over all-unique prompts prefix
caching is recorded ``skipped`` with the prefix analyser's reason (in the stored result and
in ``GET /api/v1/campaigns/{id}``), over a shared prefix it is tried first; a round's
order is kept with the campaign, so a replay never reorders it.

The runs' results are **fake recorded results** (a test double, as in
``test_campaign_service``): the objective is written as the run's stored metric.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from orchestrator.core.db import unit_of_work
from orchestrator.core.models import RunMetric
from orchestrator.core.repositories import CampaignRepository
from orchestrator.core.settings import Settings
from orchestrator.tuning import service
from orchestrator.tuning.evidence import Evidence
from orchestrator.tuning.evidence_inputs import RoundOrders
from tests.api.conftest import settings as settings  # noqa: F401 - fixture
from tests.orchestrator.tuning.test_campaign_service import (
    create,
    drive,
    finish_queued,
    labels,
    record_fake_result,
    step,
    surface,
)
from tests.orchestrator.tuning.test_campaign_service import (
    database as database,  # noqa: F401 - fixture
)
from tests.orchestrator.tuning.test_campaign_service import (
    factory as factory,  # noqa: F401 - fixture
)

APC = "engine_args.enable_prefix_caching"
NO_HITS = "the prefix analyser predicts no hits for this workload: "


def baseline(prefix_tokens: int) -> dict[str, Any]:
    return {
        "engine_args": {"max_model_len": 2048, "enable_prefix_caching": False},
        "workload": {"num_requests": 16, "prefix_tokens": prefix_tokens, "seed": 3},
    }


def test_all_unique_prompts_skip_prefix_caching_with_the_analysers_reason(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings, baseline=baseline(0))
    row = step(factory, settings, cid)
    assert labels(factory, cid) == [
        "r1.c1.incumbent",
        "r1.c1.engine_args.max_num_seqs=64",
        "r1.c1.engine_args.max_num_seqs=256",
    ]
    (skipped,) = [c for c in row.result["candidates"] if c["outcome"] == "skipped"]
    assert skipped["label"] == f"{APC}=true" and skipped["reason"].startswith(NO_HITS)
    assert "prefix cache hit rate of 0.0%" in skipped["reason"]
    assert row.result["order"]  # the round's answer, kept for every replay

    row = drive(factory, settings, cid)
    assert row.status == "succeeded"
    assert row.result["incumbent"][APC] is False  # never measured, so never adopted
    assert [c["label"] for c in row.result["candidates"] if c["outcome"] == "skipped"] == [
        f"{APC}=true"
    ]
    with TestClient(create_app(settings, factory)) as client:
        body = client.get(f"/api/v1/campaigns/{cid}").json()
    (shown,) = [c for c in body["candidates"] if c["outcome"] == "skipped"]
    assert shown["label"] == f"{APC}=true" and shown["variable"] == APC
    assert shown["reason"] == skipped["reason"] and shown["pairs"] == 0


def test_a_shared_prefix_tries_prefix_caching_first(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
) -> None:
    space = [
        {"name": "engine_args.max_num_seqs", "levels": [64, 128, 256], "start": 128},
        {"name": APC, "levels": [False, True]},
    ]  # the space lists it last; the seeds' order puts it first
    cid = create(factory, settings, baseline=baseline(512), space=space)
    row = step(factory, settings, cid)
    assert labels(factory, cid)[:2] == ["r1.c1.incumbent", f"r1.c1.{APC}=true"]
    assert not [c for c in row.result["candidates"] if c["outcome"] == "skipped"]
    row = drive(factory, settings, cid)
    assert row.status == "succeeded" and row.result["incumbent"][APC] is True


def test_a_kept_round_is_replayed_as_it_was_opened(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Evidence that changes after a round opened (here: none at all) reorders nothing:
    the campaign goes on from the runs it recorded, none queued twice."""
    cid = create(factory, settings, baseline=baseline(0))
    step(factory, settings, cid)
    finish_queued(factory, cid)
    before = labels(factory, cid)

    def no_evidence(*_: Any) -> Evidence:
        raise AssertionError("a kept round needs no evidence")

    monkeypatch.setattr(service, "gather_evidence", no_evidence)
    row = step(factory, settings, cid)
    assert row.status == "running", row.status_reason
    after = labels(factory, cid)
    assert after[: len(before)] == before and len(after) == len(set(after))
    assert after[len(before) :] == [
        "r1.c2.incumbent",
        "r1.c2.engine_args.max_num_seqs=64",
        "r1.c2.engine_args.max_num_seqs=256",
    ]


def test_a_campaign_opened_before_rounds_were_kept_goes_on_in_the_spaces_order(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A campaign whose rounds were opened without the hook (no ``order`` in its result,
    as the service stored campaigns before) replays without it: its runs stay the ones
    it planned, prefix caching among them."""
    cid = create(factory, settings, baseline=baseline(0))
    with monkeypatch.context() as m:
        m.setattr(service, "order_hook", lambda *_: (RoundOrders(), None))
        step(factory, settings, cid)
    with factory() as s, s.begin():
        row = service.get_campaign(s, cid)
        row.result = {k: v for k, v in row.result.items() if k != "order"}
    first = [
        "r1.c1.incumbent",
        f"r1.c1.{APC}=true",
        "r1.c1.engine_args.max_num_seqs=64",
        "r1.c1.engine_args.max_num_seqs=256",
    ]
    assert labels(factory, cid) == first
    finish_queued(factory, cid)
    row = step(factory, settings, cid)
    assert row.status == "running", row.status_reason
    assert labels(factory, cid) == first + [p.replace("r1.c1.", "r1.c2.") for p in first]


def finish_with_waiting(factory: sessionmaker[Session], campaign_id: str, waiting: float) -> None:  # noqa: F811
    """Fake results (``surface``) with each run's waiting-queue peak stored beside them."""
    with unit_of_work(factory) as s:
        for run in CampaignRepository(s).runs(campaign_id):
            if run.status == "queued":
                record_fake_result(s, run, surface(run))
                s.add(RunMetric(run_id=run.id, name="num_requests_waiting_peak", value=waiting))
        s.flush()


@pytest.mark.parametrize(("waiting", "second"), [(12.0, ["256", "64"]), (0.0, ["64", "256"])])
def test_the_adopted_configurations_waiting_queue_puts_batch_limits_first_in_the_next_round(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
    waiting: float,
    second: list[str],
) -> None:
    """Round 1 adopts prefix caching (x1.30 on the fake surface); its runs in round 1 are
    the evidence round 2 reads: requests waited there, so raising max_num_seqs comes before
    lowering it (without a queue, the space's order: lower first)."""
    cid = create(factory, settings, baseline=baseline(512))
    for _ in range(50):
        row = step(factory, settings, cid)
        if any(label.startswith("r2.") for label in labels(factory, cid)):
            break
        finish_with_waiting(factory, cid, waiting)
    assert row.result["path"][0]["variable"] == APC
    round2 = [label for label in labels(factory, cid) if label.startswith("r2.c1.")]
    assert round2 == ["r2.c1.incumbent"] + [f"r2.c1.engine_args.max_num_seqs={n}" for n in second]
