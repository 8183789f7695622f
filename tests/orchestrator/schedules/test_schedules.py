"""Scheduled sweeps: DST-correct fire times, validation, exactly-once firing, catch-up,
concurrency policy, end_at, disabled schedules and regression detection.

The clock is driven explicitly (``now`` passed in); a fresh database per module
keeps a running dispatcher or other tests from firing these schedules.
"""

from __future__ import annotations

import calendar
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from orchestrator.analysis.compare import compare_variant
from orchestrator.analysis.service import runs_as_data
from orchestrator.core.models import Experiment, Run, Schedule, ScheduleFire
from orchestrator.core.settings import Settings
from orchestrator.experiments.engine_catalog import load_catalog
from orchestrator.schedules.cron import next_fire_times
from orchestrator.schedules.service import fire_due_schedules
from tests.api.conftest import settings as settings  # noqa: F401 - fixture
from tests.api.test_api import _finish, demo_spec
from tests.api.test_untrusted_verdicts import _finish as finish_stub

T0 = datetime(2026, 3, 2, 8, 0, tzinfo=UTC)  # a Monday


@pytest.fixture
def client(settings: Settings, factory: sessionmaker[Session]) -> Iterator[TestClient]:  # noqa: F811
    with TestClient(create_app(settings, factory)) as c:
        yield c


def make_schedule(factory: sessionmaker[Session], **kw: Any) -> Schedule:
    """A schedule stored directly (template already valid), created at T0."""
    doc: dict[str, Any] = {
        "name": f"s-{uuid.uuid4().hex[:8]}",
        "cron": "0 * * * *",
        "timezone": "UTC",
        "template": demo_spec(),
        "concurrency_policy": "queue",
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


def fires(factory: sessionmaker[Session], schedule_id: str) -> list[ScheduleFire]:
    with factory() as s:
        return list(
            s.scalars(
                select(ScheduleFire)
                .where(ScheduleFire.schedule_id == schedule_id)
                .order_by(ScheduleFire.fire_time)
            )
        )


def fire(factory: sessionmaker[Session], settings: Settings, now: datetime) -> list[Any]:  # noqa: F811
    return fire_due_schedules(factory, settings, load_catalog(settings), now=now)


def test_next_fire_times_across_dst_in_berlin() -> None:
    after = datetime(2026, 3, 27, 12, tzinfo=UTC)
    got = next_fire_times("0 9 * * *", "Europe/Berlin", after, 4)
    assert [t.isoformat() for t in got] == [
        "2026-03-28T09:00:00+01:00",
        "2026-03-29T09:00:00+02:00",
        "2026-03-30T09:00:00+02:00",
        "2026-03-31T09:00:00+02:00",
    ]
    assert got[0].astimezone(UTC).hour == 8 and got[1].astimezone(UTC).hour == 7
    # fall back: 02:30 happens twice on 25 Oct; a fixed-hour job fires once
    autumn = next_fire_times(
        "30 2 * * *", "Europe/Berlin", datetime(2026, 10, 24, 12, tzinfo=UTC), 2
    )
    assert [t.isoformat() for t in autumn] == [
        "2026-10-25T02:30:00+02:00",
        "2026-10-26T02:30:00+01:00",
    ]


def test_crud_and_next_fire_times(client: TestClient) -> None:
    body = {
        "name": f"nightly-{uuid.uuid4().hex[:6]}",
        "cron": "0 9 * * *",
        "timezone": "Europe/Berlin",
        "template": demo_spec(),
    }
    resp = client.post("/api/v1/schedules", json=body)
    assert resp.status_code == 201, resp.text
    doc = resp.json()
    assert len(doc["next_fire_times"]) == 5
    assert all(
        t.endswith(("+01:00", "+02:00")) and "T09:00:00" in t for t in doc["next_fire_times"]
    )
    assert doc["concurrency_policy"] == "skip" and doc["catch_up"] == "latest"
    sid = doc["id"]
    assert client.get(f"/api/v1/schedules/{sid}").json()["name"] == body["name"]
    listed = client.get("/api/v1/schedules", params={"limit": 500}).json()
    assert sid in {i["id"] for i in listed["items"]} and listed["limit"] == 500
    patched = client.patch(f"/api/v1/schedules/{sid}", json={"enabled": False, "cron": "5 * * * *"})
    assert patched.status_code == 200, patched.text
    assert patched.json()["enabled"] is False and patched.json()["cron"] == "5 * * * *"
    bad = client.patch(f"/api/v1/schedules/{sid}", json={"timezone": "Mars/Olympus"})
    assert bad.status_code == 422
    past = {**body, "name": body["name"] + "-past", "end_at": "2020-01-01T00:00:00Z"}
    resp = client.post("/api/v1/schedules", json=past)
    assert resp.status_code == 422 and resp.json()["errors"][0]["loc"] == ["body", "end_at"]
    # 29 February fires only in leap years: none before the day before the next one
    now = datetime.now(UTC)
    year = next(
        y
        for y in range(now.year, now.year + 9)
        if calendar.isleap(y) and datetime(y, 2, 29, tzinfo=UTC) > now
    )
    end_at = datetime(year, 2, 28, 12, tzinfo=UTC).isoformat()
    leap = {**body, "name": body["name"] + "-leap", "cron": "0 0 29 2 *"}
    resp = client.post("/api/v1/schedules", json={**leap, "end_at": end_at})
    assert resp.status_code == 422 and "never fires before end_at" in resp.text
    for value in ("yes", 1):  # only true/false: no silent coercion of "yes" or 1
        resp = client.patch(f"/api/v1/schedules/{sid}", json={"enabled": value})
        assert resp.status_code == 422 and resp.json()["errors"][0]["loc"][-1] == "enabled"
    assert client.post("/api/v1/schedules", json=body).status_code == 409
    assert client.get(f"/api/v1/schedules/{sid}/fires").json()["items"] == []
    assert client.delete(f"/api/v1/schedules/{sid}").status_code == 204
    assert client.get(f"/api/v1/schedules/{sid}").status_code == 404


@pytest.mark.parametrize(
    ("field", "value", "loc"),
    [
        ("cron", "61 * * * *", ["body", "cron"]),
        ("cron", "0 9 * *", ["body", "cron"]),
        ("cron", "0 0 31 2 *", ["body", "cron"]),  # valid fields, a date that never exists
        ("timezone", "Europe/Atlantis", ["body", "timezone"]),
    ],
)
def test_bad_cron_or_timezone_is_422_naming_field_and_value(
    client: TestClient, factory: sessionmaker[Session], field: str, value: str, loc: list[str]
) -> None:
    name = f"bad-{uuid.uuid4().hex[:6]}"
    body = {"name": name, "cron": "0 9 * * *", "timezone": "UTC", "template": demo_spec()}
    body[field] = value
    resp = client.post("/api/v1/schedules", json=body)
    assert resp.status_code == 422
    assert resp.headers["content-type"].startswith("application/problem+json")
    (err,) = resp.json()["errors"]
    assert err["loc"] == loc and value in err["msg"]
    with factory() as s:
        assert s.scalar(select(Schedule).where(Schedule.name == name)) is None


def test_bad_template_is_422_and_nothing_stored(
    client: TestClient, factory: sessionmaker[Session]
) -> None:
    name = f"badt-{uuid.uuid4().hex[:6]}"
    template = demo_spec()
    template["baseline"]["engine_args"]["enable_prefix_cache"] = True  # typo
    with factory() as s:
        before = len(s.scalars(select(Experiment.id)).all())
    resp = client.post(
        "/api/v1/schedules",
        json={"name": name, "cron": "0 9 * * *", "template": template},
    )
    assert resp.status_code == 422, resp.text
    body = resp.json()
    assert body["code"] == "schedule_invalid"
    locs = {".".join(map(str, e["loc"])) for e in body["errors"]}
    assert "body.template.baseline.engine_args.enable_prefix_cache" in locs
    with factory() as s:
        assert s.scalar(select(Schedule).where(Schedule.name == name)) is None
        assert len(s.scalars(select(Experiment.id)).all()) == before


def test_fires_once_for_the_same_now(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    sched = make_schedule(factory)
    now = T0 + timedelta(hours=1, seconds=5)
    first = [o for o in fire(factory, settings, now) if o.schedule_id == sched.id]
    second = [o for o in fire(factory, settings, now) if o.schedule_id == sched.id]
    assert [o.status for o in first] == ["fired"] and second == []
    (row,) = fires(factory, sched.id)
    assert row.status == "fired" and row.experiment_id == first[0].experiment_id
    with factory() as s:
        got = s.get(Schedule, sched.id)
        assert got is not None and got.next_fire_at == T0 + timedelta(hours=2)


def test_two_threads_fire_exactly_once(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    sched = make_schedule(factory)
    now = T0 + timedelta(hours=1, seconds=1)
    catalog = load_catalog(settings)
    barrier = threading.Barrier(2)
    results: list[list[Any]] = []

    def worker() -> None:
        barrier.wait()
        results.append(fire_due_schedules(factory, settings, catalog, now=now))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    mine = [o for r in results for o in r if o.schedule_id == sched.id]
    assert [o.status for o in mine] == ["fired"]
    assert len(fires(factory, sched.id)) == 1
    with factory() as s:
        exp_ids = s.scalars(
            select(ScheduleFire.experiment_id).where(ScheduleFire.schedule_id == sched.id)
        ).all()
        assert len(exp_ids) == 1 and s.get(Experiment, exp_ids[0]) is not None


def test_catch_up_latest_runs_one_and_records_skipped(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    sched = make_schedule(factory)
    now = T0 + timedelta(hours=3, minutes=30)  # fires at +1h, +2h, +3h missed
    fire(factory, settings, now)
    rows = fires(factory, sched.id)
    assert [r.status for r in rows] == ["skipped", "skipped", "fired"]
    assert rows[-1].fire_time == T0 + timedelta(hours=3) and rows[-1].experiment_id
    assert sum(1 for r in rows if r.experiment_id) == 1
    assert "2 older missed" in (rows[-1].detail or "")


def test_catch_up_none_skips_all_missed(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    sched = make_schedule(factory, catch_up="none")
    fire(factory, settings, T0 + timedelta(hours=3, minutes=30))
    assert [r.status for r in fires(factory, sched.id)] == ["skipped"] * 3


def test_concurrency_policy_skip(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    sched = make_schedule(factory, concurrency_policy="skip")
    fire(factory, settings, T0 + timedelta(hours=1, seconds=2))
    fire(factory, settings, T0 + timedelta(hours=2, seconds=2))  # first sweep still queued
    rows = fires(factory, sched.id)
    assert [r.status for r in rows] == ["fired", "skipped_busy"]
    with factory() as s:  # finish the first sweep: the next fire runs
        for run in s.scalars(select(Run).where(Run.experiment_id == rows[0].experiment_id)):
            run.status = "cancelled"
        s.commit()
    fire(factory, settings, T0 + timedelta(hours=3, seconds=2))
    assert [r.status for r in fires(factory, sched.id)] == ["fired", "skipped_busy", "fired"]


def test_end_at_and_disabled(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    ended = make_schedule(factory, end_at=T0 + timedelta(hours=1, minutes=30))
    off = make_schedule(factory, enabled=False)
    fire(factory, settings, T0 + timedelta(hours=1, seconds=1))
    fire(factory, settings, T0 + timedelta(hours=2, seconds=1))
    fire(factory, settings, T0 + timedelta(hours=5, seconds=1))
    assert [r.fire_time for r in fires(factory, ended.id)] == [T0 + timedelta(hours=1)]
    assert fires(factory, off.id) == []
    with factory() as s:
        got = s.get(Schedule, ended.id)
        assert got is not None and got.next_fire_at is None


def test_regression_flagged_when_second_sweep_is_worse(
    client: TestClient,
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    sched = make_schedule(factory, template=demo_spec(repeats=3))
    fire(factory, settings, T0 + timedelta(hours=1, seconds=1))
    fire(factory, settings, T0 + timedelta(hours=2, seconds=1))
    first, second = fires(factory, sched.id)
    assert first.status == second.status == "fired"
    for f, ttft in ((first, 0.05), (second, 0.2)):
        with factory() as s:
            ids = s.scalars(select(Run.id).where(Run.experiment_id == f.experiment_id)).all()
        for rid in ids:
            _finish(factory, rid, ttft)
    resp = client.get(f"/api/v1/schedules/{sched.id}/fires")
    assert resp.status_code == 200, resp.text
    items = resp.json()["items"]
    newest, oldest = items
    assert oldest["comparison"] == "no_previous" and oldest["regressions"] == []
    assert newest["comparison"] == "compared"
    assert newest["compared_with"]["experiment_id"] == first.experiment_id
    ttft = [r for r in newest["regressions"] if r["metric"] == "median_ttft_ms"]
    assert {r["variant"] for r in ttft} == {"baseline", "apc-on"}
    assert all(r["ratio"] > 3 and 1 < r["ci_low"] <= r["ci_high"] for r in ttft)
    assert all(r["value"] > r["reference_value"] for r in ttft)


def _capacity_doc(capacity: float, lo: float, hi: float) -> dict[str, Any]:
    """A found capacity search (``CapacityResult.model_dump(mode="json")``), in requests/s."""
    return {
        "variable": "request_rate",
        "status": "found",
        "capacity": capacity,
        "interval": [lo, hi],
        "binding_slo": "ttft_ms p99",
        "steps": [],
        "note": None,
    }


def test_capacity_drop_is_a_regression(
    client: TestClient,
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    sched = make_schedule(factory, template=demo_spec(repeats=2))
    fire(factory, settings, T0 + timedelta(hours=1, seconds=1))
    fire(factory, settings, T0 + timedelta(hours=2, seconds=1))
    first, second = fires(factory, sched.id)
    # same latency in both sweeps; the apc-on capacity halves in the second, the
    # baseline's stays within its bracket
    caps = {
        (first.experiment_id, "baseline"): (4.0, 4.0, 4.2),
        (first.experiment_id, "apc-on"): (8.0, 8.0, 8.4),
        (second.experiment_id, "baseline"): (4.1, 4.1, 4.3),
        (second.experiment_id, "apc-on"): (4.0, 4.0, 4.2),
    }
    for f in (first, second):
        with factory() as s:
            ids = s.scalars(select(Run.id).where(Run.experiment_id == f.experiment_id)).all()
        for rid in ids:
            _finish(factory, rid, 0.05)
            with factory() as s:
                run = s.get(Run, rid)
                assert run is not None
                run.capacity = _capacity_doc(*caps[(f.experiment_id, run.name)])
                s.commit()
    resp = client.get(f"/api/v1/schedules/{sched.id}/fires")
    assert resp.status_code == 200, resp.text
    newest, _ = resp.json()["items"]
    assert newest["comparison"] == "compared"
    (cap,) = [r for r in newest["regressions"] if r["metric"] == "capacity"]
    assert cap["variant"] == "apc-on" and cap["unit"] == "requests/s"
    assert cap["reference_value"] == 8.0 and cap["value"] == 4.0
    assert cap["ratio"] == 0.5 and cap["ci_of"] == "ratio"
    assert cap["ci_low"] <= cap["ratio"] <= cap["ci_high"] < 1


def _sweeps(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
    **template: Any,
) -> tuple[Schedule, ScheduleFire, ScheduleFire]:
    sched = make_schedule(factory, template=demo_spec(**template))
    fire(factory, settings, T0 + timedelta(hours=1, seconds=1))
    fire(factory, settings, T0 + timedelta(hours=2, seconds=1))
    first, second = fires(factory, sched.id)
    return sched, first, second


def _run_ids(factory: sessionmaker[Session], f: ScheduleFire) -> list[tuple[str, str]]:
    with factory() as s:
        rows = s.execute(select(Run.id, Run.name).where(Run.experiment_id == f.experiment_id)).all()
    return [(str(i), str(n)) for i, n in rows]


def test_a_burst_tpot_is_withheld_never_a_regression(
    client: TestClient,
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    # the previous sweep's apc-on streamed in bursts (TPOT ~0 ms), the new one is paced
    # (~4 ms): the raw numbers say "TPOT 100x worse"; the flag says the old ones measure
    # nothing, so there is no verdict and no regression
    sched, first, second = _sweeps(factory, settings, repeats=2)
    for f in (first, second):
        for rid, name in _run_ids(factory, f):
            kind = "burst" if f is first and name == "apc-on" else "paced"
            finish_stub(factory, rid, kind)
    newest, _ = client.get(f"/api/v1/schedules/{sched.id}/fires").json()["items"]
    assert newest["comparison"] == "compared"
    flagged = {(r["variant"], r["metric"]) for r in newest["regressions"]}
    for metric in ("median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms"):
        assert ("apc-on", metric) not in flagged
    withheld = {(w["variant"], w["metric"]): w["reason"] for w in newest["withheld"]}
    assert "token bursts" in withheld[("apc-on", "median_tpot_ms")]
    assert withheld[("apc-on", "median_tpot_ms")].startswith("reference run ")
    assert ("baseline", "median_tpot_ms") not in withheld  # paced in both sweeps
    assert not any(v == "baseline" for v, _ in flagged)  # same stub, same numbers
    # the schedule page lists what was not checked and why
    page = client.get(f"/schedules/{sched.id}").text
    assert "not checked: flagged untrustworthy" in page and "token bursts" in page


def test_a_one_sided_capacity_drop_is_a_regression_and_unknown_never(
    client: TestClient,
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    sched, first, second = _sweeps(factory, settings, repeats=1)
    caps = {
        # at least 24 before, found 8 now: lower, at most 8.4 / 24
        (first.experiment_id, "apc-on"): {
            **_capacity_doc(24.0, 24.0, 24.0),
            "status": "client_limited",
            "capacity": None,
            "interval": [24.0, None],
        },
        (second.experiment_id, "apc-on"): _capacity_doc(8.0, 8.0, 8.4),
        # at least 16 in both: nothing follows, no regression
        (first.experiment_id, "baseline"): {
            **_capacity_doc(16.0, 16.0, 16.0),
            "status": "at_least_max",
            "capacity": None,
            "interval": [16.0, None],
        },
        (second.experiment_id, "baseline"): {
            **_capacity_doc(4.0, 4.0, 4.0),
            "status": "at_least_max",
            "capacity": None,
            "interval": [4.0, None],
        },
    }
    for f in (first, second):
        for rid, name in _run_ids(factory, f):
            _finish(factory, rid, 0.05)
            with factory() as s:
                run = s.get(Run, rid)
                assert run is not None
                run.capacity = caps[(f.experiment_id, name)]
                s.commit()
    newest, _ = client.get(f"/api/v1/schedules/{sched.id}/fires").json()["items"]
    (cap,) = [r for r in newest["regressions"] if r["metric"] == "capacity"]
    assert cap["variant"] == "apc-on"
    assert cap["reference_value"] is None and cap["value"] == 8.0
    assert cap["ci_low"] is None and abs(cap["ci_high"] - 8.4 / 24.0) < 1e-9
    assert cap["statement"] == "lower: at most 0.35x (at least 24 -> found 8 [8, 8.4] requests/s)"
    page = client.get(f"/schedules/{sched.id}").text
    assert "lower: at most 0.35x" in page


def test_a_worse_change_under_the_floor_is_no_regression(
    client: TestClient,
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    # the baseline's TTFT 0.2 % longer in the new sweep, the same in every repeat: its
    # output throughput (100 / TTFT) falls 0.2 % with an interval of no width, a "worse"
    # verdict under the 5 % floor; apc-on's TTFT quadruples: a regression
    sched, first, second = _sweeps(factory, settings, repeats=2)
    ttft = {"baseline": (0.05, 0.0501), "apc-on": (0.05, 0.2)}
    for k, f in enumerate((first, second)):
        for rid, name in _run_ids(factory, f):
            _finish(factory, rid, ttft[name][k])
    with factory() as s:
        exp = {f: s.get(Experiment, f.experiment_id) for f in (first, second)}
        old, new = (runs_as_data(s, list(e.runs)) for e in exp.values() if e is not None)
        stats = compare_variant(new["baseline"], old["baseline"], n_boot=1000, seed=0)
    (tput,) = [c for c in stats if c.metric == "output_throughput"]
    assert tput.verdict == "worse" and tput.ratio == pytest.approx(0.05 / 0.0501)
    newest, _ = client.get(f"/api/v1/schedules/{sched.id}/fires").json()["items"]
    assert newest["comparison"] == "compared"
    listed = {(r["variant"], r["metric"]) for r in newest["regressions"]}
    assert ("apc-on", "output_throughput") in listed and ("apc-on", "median_ttft_ms") in listed
    assert not any(v == "baseline" for v, _ in listed)
    assert newest["withheld"] == []  # withheld is for untrusted metrics only
    # ... but said: the baseline's worse changes under the floor, none of apc-on's
    under = {(r["variant"], r["metric"]): r for r in newest["under_floor"]}
    assert ("baseline", "output_throughput") in under and ("baseline", "p99_ttft_ms") in under
    assert under["baseline", "output_throughput"]["ratio"] == pytest.approx(0.05 / 0.0501)
    assert not any(v == "apc-on" for v, _ in under)
    assert not set(under) & listed
    page = client.get(f"/schedules/{sched.id}").text
    assert f"{len(under)} metrics worse by less than the 5 % regression floor" in page
    assert 'class="under-floor-row" data-metric="output_throughput" data-variant="baseline"' in page
    assert "×0.998 [0.998, 0.998]" in page
