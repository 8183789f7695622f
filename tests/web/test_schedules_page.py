"""The schedules pages in a real Chromium: the list (next fire times in the schedule's
zone and UTC, latest fire outcome), the detail page (fire history with a skipped fire
and a regression flagged by the real bootstrap comparison), the enable/disable button,
pagination, the empty state and the 404 page.

Schedules and sweeps are created through the real API (``POST /api/v1/schedules``,
``POST /api/v1/experiments``); the sweeps' runs get measured requests and the fire
rows are written with ``web_db`` (no dispatcher runs in the test server). Everything
added here is deleted again at the end of the module, so the other dashboard tests'
counts stay exact.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest
from croniter import croniter
from playwright.sync_api import Page, expect
from sqlalchemy import delete, update
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.models import Experiment, Schedule, ScheduleFire
from tests.api.test_api import _finish, demo_spec
from tests.web.conftest import allow_console_error, screenshot

NY = "America/New_York"
NY_CRON = "30 9 * * 1-5"  # 09:30 New York time, Monday to Friday
# fire times of the seeded history (09:30 New York = 14:30 UTC in November)
F1 = datetime(2026, 11, 24, 14, 30, tzinfo=UTC)  # fired, sweep 1 (fast)
F2 = datetime(2026, 11, 25, 14, 30, tzinfo=UTC)  # skipped (catch-up)
F3 = datetime(2026, 11, 26, 14, 30, tzinfo=UTC)  # fired, sweep 2 (TTFT 4x slower)


def _eventually(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Wait for ``check()``: the API commits its unit of work just after answering
    (FastAPI runs a yield dependency's exit after the response), so a write is
    visible to another connection a moment later."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout_s} s: {what}")
        time.sleep(0.05)


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _post_schedule(live_server: str, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": _unique("web-sched"),
        "cron": NY_CRON,
        "timezone": NY,
        "template": demo_spec(repeats=3),
        "concurrency_policy": "skip",
        "catch_up": "latest",
    }
    body.update(kw)
    resp = httpx.post(live_server + "/api/v1/schedules", json=body, timeout=60)
    assert resp.status_code == 201, resp.text
    url = f"{live_server}/api/v1/schedules/{resp.json()['id']}"
    _eventually(lambda: httpx.get(url).status_code == 200, f"schedule {body['name']}")
    return dict(resp.json())


def _croniter_times(cron: str, tz: str, count: int) -> list[datetime]:
    """The next ``count`` fire times computed directly with croniter, in the zone."""
    it = croniter(cron, datetime.now(UTC).astimezone(ZoneInfo(tz)))
    return [it.get_next(datetime) for _ in range(count)]


def _local(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M ") + str(t.tzname())


def _utc(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


@pytest.fixture(scope="module")
def sweeps(live_server: str, web_db: sessionmaker[Session]) -> Iterator[dict[str, Any]]:
    """A New York schedule with three fires: F1 fired (sweep 1, TTFT 50 ms), F2 skipped,
    F3 fired (sweep 2, TTFT 200 ms: a regression on every variant)."""
    sched = _post_schedule(live_server, name=_unique("nightly apc"))
    exp_ids = []
    for name, ttft_s in (("sweep fast", 0.05), ("sweep slow", 0.2)):
        resp = httpx.post(
            live_server + "/api/v1/experiments",
            json=demo_spec(repeats=3, name=_unique(name)),
            timeout=60,
        )
        assert resp.status_code == 201, resp.text
        body = resp.json()
        exp_url = f"{live_server}/api/v1/experiments/{body['id']}"
        _eventually(lambda: httpx.get(exp_url).status_code == 200, f"experiment {name}")  # noqa: B023
        for run in body["runs"]:
            _finish(web_db, run["id"], ttft_s)
        exp_ids.append(body["id"])
    with web_db.begin() as s:
        s.add_all(
            [
                ScheduleFire(
                    schedule_id=sched["id"], fire_time=F1, status="fired", experiment_id=exp_ids[0]
                ),
                ScheduleFire(
                    schedule_id=sched["id"],
                    fire_time=F2,
                    status="skipped",
                    detail="missed; catch-up ran a later fire",
                ),
                ScheduleFire(
                    schedule_id=sched["id"],
                    fire_time=F3,
                    status="fired",
                    experiment_id=exp_ids[1],
                    detail="1 older missed fire(s) skipped",
                ),
            ]
        )
        s.execute(update(Schedule).where(Schedule.id == sched["id"]).values(last_fire_at=F3))
    yield {"schedule": sched, "experiments": exp_ids}
    with web_db.begin() as s:
        s.execute(delete(Experiment).where(Experiment.id.in_(exp_ids)))
        s.execute(delete(Schedule).where(Schedule.name.like("web-sched-%")))
        s.execute(delete(Schedule).where(Schedule.id == sched["id"]))


def test_empty_state_explains_how_to_create_a_schedule(page: Page, live_server: str) -> None:
    # runs before the module's fixture creates any schedule (nothing else makes one)
    assert httpx.get(live_server + "/api/v1/schedules").json()["total"] == 0
    page.goto(live_server + "/schedules")
    empty = page.locator("#empty")
    expect(empty).to_contain_text("No schedules yet")
    expect(empty).to_contain_text("POST /api/v1/schedules")
    expect(empty.locator("pre")).to_contain_text('"cron": "0 2 * * *"')
    expect(empty.locator("a[href='/docs']")).to_be_visible()
    expect(page.locator("header nav a[aria-current=page]")).to_have_text("Schedules")


def test_list_shows_next_fire_times_and_latest_outcome(
    page: Page, live_server: str, sweeps: dict[str, Any]
) -> None:
    sched = sweeps["schedule"]
    api_fires = httpx.get(f"{live_server}/api/v1/schedules/{sched['id']}/fires").json()
    flagged = api_fires["items"][0]["regressions"]
    assert flagged  # the API flags the slower sweep

    expected = _croniter_times(NY_CRON, NY, 3)
    page.goto(live_server + "/schedules")
    row = page.locator(f"#schedule-{sched['id']}")
    expect(row.locator("td").first).to_have_text(sched["name"])
    expect(row.locator(".cron")).to_have_text(NY_CRON)
    expect(row.locator(".tz")).to_have_text(NY)
    expect(row.locator("td.enabled .enabled-flag")).to_have_text("enabled")
    expect(row.locator(".policy")).to_have_text("skip")
    expect(row.locator(".catch-up")).to_have_text("latest")
    expect(row.locator("td.end")).to_have_text("–")
    expect(row.locator("td.last-fire")).to_contain_text("2026-11-26 09:30 EST")
    expect(row.locator("td.last-fire")).to_contain_text("2026-11-26 14:30 UTC")

    # next 3 fire times: wall clock in New York (as croniter computes it) and UTC
    times = row.locator("td.next li")
    expect(times).to_have_count(3)
    for li, t in zip(times.all(), expected, strict=True):
        expect(li.locator("time")).to_have_text(_local(t))
        expect(li.locator("time")).to_have_attribute("datetime", t.isoformat())
        expect(li.locator(".utc")).to_have_text(_utc(t))
        assert t.minute == 30 and t.hour == 9 and t.weekday() < 5

    # latest fire: F3, sweep 2 (succeeded) with the regressions the API flags, in red
    expect(row.locator("td.latest .fire-status")).to_have_text("fired")
    link = row.locator("td.sweep a")
    expect(link).to_have_attribute("href", f"/experiments/{sweeps['experiments'][1]}")
    expect(link).to_contain_text("sweep slow")
    expect(row.locator("td.sweep .status")).to_have_text("succeeded")
    reg = row.locator("td.regressions .regression")
    expect(reg).to_have_text(f"{len(flagged)} flagged")
    assert reg.evaluate("e => getComputedStyle(e).color") == "rgb(207, 34, 46)"
    screenshot(page, "schedules")


def test_detail_shows_settings_next_fires_and_fire_history_with_regression(
    page: Page, live_server: str, sweeps: dict[str, Any]
) -> None:
    sched = sweeps["schedule"]
    fast, slow = sweeps["experiments"]
    expected = _croniter_times(NY_CRON, NY, 10)
    page.goto(f"{live_server}/schedules/{sched['id']}")
    expect(page.locator("h1")).to_contain_text(sched["name"])
    expect(page.locator("#cron")).to_have_text(NY_CRON)
    expect(page.locator("#tz")).to_have_text(NY)
    # the template, pretty-printed inside a closed <details>
    details = page.locator("details#template")
    expect(details.locator("pre")).to_be_hidden()
    details.locator("summary").click()
    expect(details.locator("pre")).to_contain_text('"enable_prefix_caching": false')
    expect(details.locator("pre")).to_contain_text('"repeats": 3')

    # next 10 fire times, New York and UTC
    next_rows = page.locator("#next tbody tr")
    expect(next_rows).to_have_count(10)
    assert next_rows.locator("time").all_inner_texts() == [_local(t) for t in expected]
    assert next_rows.locator("td.utc-cell").all_inner_texts() == [_utc(t) for t in expected]

    # fires, newest first: F3 fired (regression), F2 skipped, F1 fired (nothing to compare)
    expect(page.locator("#fire-total")).to_have_text("3")
    rows = page.locator("#fires > tbody > tr")
    expect(rows).to_have_count(3)
    assert [r.get_attribute("data-status") for r in rows.all()] == ["fired", "skipped", "fired"]
    newest, skipped, oldest = rows.all()
    expect(newest.locator("time")).to_have_text("2026-11-26 09:30 EST")
    expect(skipped.locator(".outcome")).to_contain_text("missed; catch-up ran a later fire")
    expect(skipped.locator(".sweep")).to_have_text("no experiment")
    expect(oldest.locator(".regressions")).to_have_text(
        "no previous completed sweep to compare with"
    )
    expect(oldest.locator(".sweep a")).to_have_attribute("href", f"/experiments/{fast}")

    # the regression check of F3 against F1 (the previous *completed* sweep)
    expect(newest.locator(".sweep a")).to_have_attribute("href", f"/experiments/{slow}")
    expect(newest.locator(".regressions > span.muted a")).to_have_attribute(
        "href", f"/experiments/{fast}"
    )
    api = httpx.get(f"{live_server}/api/v1/schedules/{sched['id']}/fires").json()["items"][0]
    regs = newest.locator("tr.regression-row")
    expect(regs).to_have_count(len(api["regressions"]))
    ttft = newest.locator("tr.regression-row[data-metric=median_ttft_ms]")
    expect(ttft).to_have_count(2)
    assert {r.get_attribute("data-variant") for r in ttft.all()} == {"baseline", "apc-on"}
    base = newest.locator("tr.regression-row[data-metric=median_ttft_ms][data-variant=baseline]")
    cells = base.locator("td").all_inner_texts()
    api_base = next(
        r
        for r in api["regressions"]
        if (r["metric"], r["variant"]) == ("median_ttft_ms", "baseline")
    )
    assert cells[1] == "TTFT p50 (ms)"
    assert float(cells[2]) == pytest.approx(api_base["reference_value"], abs=0.01)
    assert float(cells[3]) == pytest.approx(api_base["value"], abs=0.01)
    assert 49 < float(cells[2]) < 53 and 199 < float(cells[3]) < 212  # 50 ms -> 200 ms
    assert cells[4] == (
        f"×{api_base['ratio']:.2f} [{api_base['ci_low']:.2f}, {api_base['ci_high']:.2f}]"
    )
    assert api_base["ratio"] > 3.5
    color = base.locator("td").nth(4).evaluate("e => getComputedStyle(e).color")
    assert color == "rgb(207, 34, 46)"
    screenshot(page, "schedule")


def test_toggle_button_disables_and_enables_through_the_api(
    page: Page, live_server: str, sweeps: dict[str, Any]
) -> None:
    sched = _post_schedule(live_server, cron="0 */6 * * *", timezone="Asia/Kolkata")
    url = f"{live_server}/api/v1/schedules/{sched['id']}"
    page.goto(live_server + "/schedules")
    row = page.locator(f"#schedule-{sched['id']}")
    expect(row.locator("td.next li")).to_have_count(3)
    # Kolkata is UTC+05:30: 00:00/06:00/12:00/18:00 local are 18:30/00:30/06:30/12:30 UTC
    for t in _croniter_times("0 */6 * * *", "Asia/Kolkata", 3):
        expect(row.locator("td.next")).to_contain_text(_utc(t))
        assert _utc(t).endswith(":30 UTC")

    row.locator("button.toggle").click()
    expect(row.locator(".enabled-flag")).to_have_text("disabled")
    expect(row.locator("button.toggle")).to_have_text("Enable")
    expect(row.locator("td.next")).to_have_text("disabled: no fires")
    _eventually(lambda: httpx.get(url).json()["enabled"] is False, "disabled")

    row.locator("button.toggle").click()
    expect(row.locator(".enabled-flag")).to_have_text("enabled")
    expect(row.locator("td.next li")).to_have_count(3)
    _eventually(lambda: httpx.get(url).json()["enabled"] is True, "enabled")

    # on the detail page: the settings and the next fire times follow
    page.goto(f"{live_server}/schedules/{sched['id']}")
    expect(page.locator("#next tbody tr")).to_have_count(10)
    page.locator("button.toggle").click()
    expect(page.locator("#enabled-flag")).to_have_text("disabled")
    expect(page.locator("#enabled")).to_contain_text("no")
    expect(page.locator("#no-next")).to_contain_text("Disabled")
    _eventually(lambda: httpx.get(url).json()["enabled"] is False, "disabled on detail page")


def test_toggle_failure_shows_the_problem_detail(
    page: Page, live_server: str, sweeps: dict[str, Any]
) -> None:
    sched = _post_schedule(live_server)
    page.goto(live_server + "/schedules")
    row = page.locator(f"#schedule-{sched['id']}")
    expect(row.locator(".enabled-flag")).to_have_text("enabled")
    # deleted behind the page's back: the PATCH answers 404 problem+json
    url = f"{live_server}/api/v1/schedules/{sched['id']}"
    assert httpx.delete(url).status_code == 204
    _eventually(lambda: httpx.get(url).status_code == 404, "schedule deleted")
    allow_console_error(page, "status of 404")
    row.locator("button.toggle").click()
    error = row.locator(".toggle-error")
    expect(error).to_have_text(f"could not disable: no schedule {sched['id']}")
    expect(row.locator(".enabled-flag")).to_have_text("enabled")
    expect(row.locator("button.toggle")).to_be_enabled()


def test_unknown_schedule_is_404(page: Page, live_server: str) -> None:
    allow_console_error(page, "status of 404")
    resp = page.goto(live_server + "/schedules/no-such-schedule")
    assert resp is not None and resp.status == 404
    expect(page.locator("h1")).to_have_text("Not found")
    expect(page.locator(".error")).to_contain_text("No schedule no-such-schedule")


def test_list_is_paginated_by_50(
    page: Page, live_server: str, web_db: sessionmaker[Session], sweeps: dict[str, Any]
) -> None:
    old = datetime(2020, 1, 1, tzinfo=UTC)
    with web_db.begin() as s:
        s.add_all(
            Schedule(
                name=f"web-sched-bulk-{i:03d}",
                cron="0 3 * * *",
                timezone="UTC",
                template=demo_spec(),
                enabled=False,
                created_at=old + timedelta(minutes=i),
                updated_at=old,
            )
            for i in range(55)
        )
    total = httpx.get(live_server + "/api/v1/schedules").json()["total"]
    assert total >= 56
    page.goto(live_server + "/schedules")
    expect(page.locator("#total")).to_have_text(f"{total} schedules")
    expect(page.locator("#rows > tr")).to_have_count(50)
    # newest first: the module's schedule (created now) before the 2020 ones
    expect(page.locator(f"#schedule-{sweeps['schedule']['id']}")).to_have_count(1)
    page.click("a[rel=next]")
    expect(page.locator("#rows > tr")).to_have_count(total - 50)
    last = page.locator("#rows > tr").last
    expect(last.locator("td").first).to_have_text("web-sched-bulk-000")
    expect(last.locator("td.next")).to_have_text("disabled: no fires")
    expect(last.locator("td.latest")).to_have_text("never fired")
    page.goto(live_server + "/schedules?page=99")
    expect(page.locator("#rows")).to_contain_text("No schedules on page 99")


def test_detail_page_shows_new_fires_without_reload(
    page: Page, live_server: str, web_db: sessionmaker[Session]
) -> None:
    """A fire that happens while the page is open appears by itself (live re-render)."""
    sched = _post_schedule(live_server)
    try:
        page.goto(f"{live_server}/schedules/{sched['id']}?live_ms=1000")
        expect(page.locator("#fire-total")).to_have_text("0")
        page.evaluate("window.__marker = 1")
        with web_db.begin() as s:
            s.add(
                ScheduleFire(
                    schedule_id=sched["id"],
                    fire_time=datetime(2026, 11, 30, 9, 0, tzinfo=UTC),
                    status="skipped_busy",
                    detail="the previous sweep is still running",
                )
            )
        expect(page.locator("#fire-total")).to_have_text("1", timeout=10_000)
        expect(page.locator("#fires")).to_contain_text("skipped_busy")
        assert page.evaluate("window.__marker") == 1  # not reloaded
    finally:
        httpx.delete(f"{live_server}/api/v1/schedules/{sched['id']}")
