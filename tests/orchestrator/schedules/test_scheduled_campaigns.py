"""Scheduled campaigns: a schedule holding a campaign request starts one campaign per fire
time through the campaign intake, and each ended campaign says whether the best
configuration moved since the previous one (or held).

Campaigns are advanced by the service (what the dispatcher's ``campaigns`` loop calls)
and their runs get **fake recorded results** (the objective as the run's stored metric,
from a known surface). The clock is driven explicitly; a fresh database per module.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from orchestrator.core.db import unit_of_work
from orchestrator.core.models import Campaign, Run, Schedule, ScheduleFire
from orchestrator.core.repositories import CampaignRepository
from orchestrator.core.settings import Settings
from orchestrator.schedules.service import fire_due_schedules
from orchestrator.tuning import service as tuning
from tests.api.conftest import settings as settings  # noqa: F401 - fixture
from tests.orchestrator.tuning.test_campaign_service import campaign_doc, record_fake_result

T0 = datetime(2026, 3, 2, 8, 0, tzinfo=UTC)
PROBLEM = "application/problem+json"


@pytest.fixture
def client(settings: Settings, factory: sessionmaker[Session]) -> Iterator[TestClient]:  # noqa: F811
    with TestClient(create_app(settings, factory)) as c:
        yield c


def make_campaign_schedule(factory: sessionmaker[Session], **kw: Any) -> Schedule:
    """A campaign schedule stored directly (its request valid), hourly, created at T0."""
    doc: dict[str, Any] = {
        "name": f"retune-{uuid.uuid4().hex[:8]}",
        "cron": "0 * * * *",
        "timezone": "UTC",
        "campaign": campaign_doc(name="nightly retune"),
        "concurrency_policy": "skip",
        "catch_up": "latest",
        "created_at": T0,
        "updated_at": T0,
        "next_fire_at": T0 + timedelta(hours=1),
    }
    doc.update(kw)
    with factory() as s:
        sched = Schedule(**doc)
        s.add(sched)
        s.commit()
        return sched


def fires_of(factory: sessionmaker[Session], schedule_id: str) -> list[ScheduleFire]:
    with factory() as s:
        return list(
            s.scalars(
                select(ScheduleFire)
                .where(ScheduleFire.schedule_id == schedule_id)
                .order_by(ScheduleFire.fire_time)
            )
        )


def campaign_count(factory: sessionmaker[Session]) -> int:
    with factory() as s:
        return int(s.scalar(select(func.count()).select_from(Campaign)) or 0)


def surface(seqs_pay: bool) -> Callable[[Run], float]:
    """The fake objective: prefix caching x1.30, max_num_seqs 64 x0.90; 256 inert, or
    x1.20 with ``seqs_pay`` (the traffic changed: the best configuration moves); +-1 %
    noise seeded by the run's label."""

    def value(run: Run) -> float:
        args = run.explicit_engine_args or {}
        v = 1000.0 * (1.30 if args.get("enable_prefix_caching") else 1.0)
        v *= {64: 0.90, 256: 1.20 if seqs_pay else 1.0}.get(args.get("max_num_seqs"), 1.0)
        digest = hashlib.sha256(str(run.campaign_label).encode()).digest()
        return v * (1 + 0.01 * (digest[0] / 255 * 2 - 1))

    return value


def drive(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
    campaign_id: str,
    objective: Callable[[Run], float],
) -> Campaign:
    """Advance the campaign, recording fake results for its queued runs, until it ends."""
    for _ in range(200):
        with unit_of_work(factory) as s:
            row = tuning.advance(s, settings, campaign_id)
            assert row is not None
            if row.status != "running":
                return row
        with unit_of_work(factory) as s:
            for run in CampaignRepository(s).runs(campaign_id):
                if run.status == "queued":
                    record_fake_result(s, run, objective(run))
    raise AssertionError("the campaign did not end")


def fire(factory: sessionmaker[Session], settings: Settings, now: datetime) -> list[Any]:  # noqa: F811
    return fire_due_schedules(factory, settings, now=now)


def fire_of(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
    now: datetime,
    sched: Schedule,
) -> list[Any]:
    """The fire rows one firing wrote for ``sched``."""
    return [o for o in fire(factory, settings, now) if o.schedule_id == sched.id]


def test_a_fire_starts_exactly_one_campaign_through_the_intake(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    sched = make_campaign_schedule(factory)
    before = campaign_count(factory)
    now = T0 + timedelta(hours=1, seconds=1)
    barrier = threading.Barrier(2)
    results: list[list[Any]] = []

    def worker() -> None:
        barrier.wait()
        results.append(fire(factory, settings, now))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    mine = [o for r in results for o in r if o.schedule_id == sched.id]
    assert [o.status for o in mine] == ["fired"] and mine[0].campaign_id is not None
    assert fire(factory, settings, now) == []  # the same fire time again: nothing
    (row,) = fires_of(factory, sched.id)
    assert row.status == "fired" and row.campaign_id == mine[0].campaign_id
    assert row.experiment_id is None
    assert campaign_count(factory) == before + 1  # the loser's prepared campaign is gone
    with factory() as s:
        campaign = s.get(Campaign, row.campaign_id)
        assert campaign is not None and campaign.status == "queued"
        assert campaign.submitted_by == f"schedule:{sched.name}"
        # stored as the intake stores a submission: the defaults resolved
        assert campaign.request["objective"]["direction"] == "higher"
        assert campaign.request["space"][0]["start"] is False
        got = s.get(Schedule, sched.id)
        assert got is not None and got.next_fire_at == T0 + timedelta(hours=2)


def test_an_invalid_campaign_fires_failed_and_starts_nothing(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    bad = campaign_doc(space=[{"name": "engine_args.max_num_seq", "levels": [1, 2], "start": 1}])
    sched = make_campaign_schedule(factory, campaign=bad)
    before = campaign_count(factory)
    (out,) = fire_of(factory, settings, T0 + timedelta(hours=1), sched)
    assert out.status == "failed" and out.campaign_id is None
    assert out.detail is not None and out.detail.startswith("campaign_invalid")
    assert campaign_count(factory) == before


def test_each_ended_campaign_says_whether_the_best_configuration_moved(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
    client: TestClient,
) -> None:
    sched = make_campaign_schedule(factory)
    t1 = T0 + timedelta(hours=1)
    (first,) = fire_of(factory, settings, t1, sched)
    # policy skip: the next fire time while the first campaign runs is skipped
    (busy,) = fire_of(factory, settings, t1 + timedelta(hours=1), sched)
    assert busy.status == "skipped_busy" and first.campaign_id in (busy.detail or "")
    url = f"/api/v1/schedules/{sched.id}"
    assert client.get(url).json()["last_movement"]["comparison"] == "pending"
    drive(factory, settings, first.campaign_id, surface(seqs_pay=False))
    moved = client.get(url).json()["last_movement"]
    assert moved["comparison"] == "no_previous" and moved["campaign_status"] == "succeeded"
    assert moved["final"]["engine_args.enable_prefix_caching"] is True
    assert moved["serve_command"].startswith("vllm serve tiny")

    (second,) = fire_of(factory, settings, t1 + timedelta(hours=2), sched)
    drive(factory, settings, second.campaign_id, surface(seqs_pay=False))
    held = client.get(url).json()["last_movement"]
    assert held["comparison"] == "held" and held["changes"] == []
    assert held["compared_with"]["campaign_id"] == first.campaign_id
    assert held["summary"].startswith("held")

    (third,) = fire_of(factory, settings, t1 + timedelta(hours=3), sched)
    drive(factory, settings, third.campaign_id, surface(seqs_pay=True))
    body = client.get(url).json()
    assert body["kind"] == "campaign" and body["template"] is None
    last = body["last_movement"]
    assert last["campaign_id"] == third.campaign_id and last["comparison"] == "moved"
    assert last["changes"] == [
        {"variable": "engine_args.max_num_seqs", "from_level": 128, "to_level": 256}
    ]
    assert last["compared_with"]["campaign_id"] == second.campaign_id
    assert last["summary"] == "moved: engine_args.max_num_seqs 128 -> 256"
    assert last["campaign_url"].endswith(f"/api/v1/campaigns/{third.campaign_id}")
    page = client.get(f"{url}/fires").json()["items"]
    assert [f["status"] for f in page] == ["fired", "fired", "skipped_busy", "fired"]
    assert [f["comparison"] for f in page] == ["not_a_sweep", "not_a_sweep", "not_fired"] + [
        "not_a_sweep"
    ]
    assert [f["movement"]["comparison"] if f["movement"] else None for f in page] == [
        "moved",
        "held",
        None,
        "no_previous",
    ]
    html = client.get(f"/schedules/{sched.id}").text
    assert "moved: engine_args.max_num_seqs 128 -&gt; 256" in html
    assert 'data-variable="engine_args.max_num_seqs"' in html
    listed = client.get("/schedules").text  # the list shows the latest fire's movement
    assert f'<a href="/campaigns/{third.campaign_id}">campaign' in listed


def test_campaign_schedules_over_http_checked_like_a_campaign(
    client: TestClient, factory: sessionmaker[Session]
) -> None:
    before = campaign_count(factory)
    body = {
        "name": f"retune-{uuid.uuid4().hex[:6]}",
        "cron": "0 3 * * *",
        "campaign": campaign_doc(),
    }
    resp = client.post("/api/v1/schedules", json=body)
    assert resp.status_code == 201, resp.text
    doc = resp.json()
    assert doc["kind"] == "campaign" and doc["template"] is None
    assert doc["campaign"]["space"][1]["start"] == 128 and doc["recent_fires"] == []
    assert campaign_count(factory) == before  # checked, not started
    # a bad level: the campaign's own 422, located under body.campaign; nothing stored
    bad_space = [{"name": "engine_args.max_num_seq", "levels": [1, 2], "start": 1}]
    bad = {**body, "name": body["name"] + "-bad", "campaign": campaign_doc(space=bad_space)}
    resp = client.post("/api/v1/schedules", json=bad)
    assert resp.status_code == 422 and resp.headers["content-type"].startswith(PROBLEM)
    assert resp.json()["code"] == "campaign_invalid"
    locs = [e["loc"] for e in resp.json()["errors"]]
    assert ["body", "campaign", "space", 0, "levels", 0] in locs
    listed = client.get("/api/v1/schedules", params={"limit": 500}).json()["items"]
    names = {i["name"] for i in listed}
    assert bad["name"] not in names and campaign_count(factory) == before
    # the schema: both kinds, or neither, is the framework's 422
    both = {**body, "name": body["name"] + "-both", "template": {"name": "x"}}
    assert client.post("/api/v1/schedules", json=both).status_code == 422
    neither = {k: v for k, v in body.items() if k != "campaign"}
    assert client.post("/api/v1/schedules", json=neither).status_code == 422
    # a PATCH with a bad campaign is refused; a valid one stays a campaign schedule
    sid = doc["id"]
    resp = client.patch(
        f"/api/v1/schedules/{sid}", json={"campaign": campaign_doc(space=bad_space)}
    )
    assert resp.status_code == 422 and resp.json()["code"] == "campaign_invalid"
    patched = client.patch(
        f"/api/v1/schedules/{sid}", json={"campaign": campaign_doc(name="retuned")}
    ).json()
    assert patched["kind"] == "campaign" and patched["campaign"]["name"] == "retuned"
    assert campaign_count(factory) == before
    page = client.get(f"/schedules/{sid}").text
    assert "Campaign request" in page
