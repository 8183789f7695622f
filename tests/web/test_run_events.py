"""The run page's engine events: the "Engine events" table and the markers on the
time-series charts (``web/static/js/runevents.js``), on a copy of the real demo run
carrying the events the runner stores (:func:`jobs.signals.engineevents.place_events` of real
shapes: vLLM 0.32's ``EngineCore encountered a fatal error.``, ``vllm/v1/engine/core.py``;
a V0 preemption warning, GAIR-NLP/LIMO#29; a torch NCCL watchdog line without a time,
vllm-project/vllm#2734)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from jobs.signals.engineevents import parse_events, place_events
from orchestrator.core.models import Experiment, Run, RunSample
from tests.web.conftest import screenshot
from tests.web.seed import DATA, load_export

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _at(seconds: int) -> str:
    """vLLM's record time (``%m-%d %H:%M:%S``) ``seconds`` after the run began."""
    return (T0 + timedelta(seconds=seconds)).strftime("%m-%d %H:%M:%S")


@pytest.fixture(scope="module")
def with_events(web_db: sessionmaker[Session]) -> Iterator[dict[str, Any]]:
    with web_db.begin() as s:
        ids = load_export(s, DATA / "demo_experiment.json", name=f"ev-{uuid.uuid4().hex[:6]}")
        rid = ids["runs"]["apc-on#0"]
        t = sorted(s.scalars(select(RunSample.t_s).where(RunSample.run_id == rid)))
        mid, beyond = round((t[0] + t[-1]) / 2), round(t[-1] + 20)
        log = "\n".join(
            [
                f"WARNING {_at(mid)} scheduler.py:1560] Sequence group 7 is preempted "
                "by PreemptionMode.RECOMPUTE mode because there is not enough KV cache space.",
                "[rank0]:[E ProcessGroupNCCL.cpp:563] [Rank 0] Watchdog caught collective "
                "operation timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE) ran for 600059 ms",
                f"(EngineCore_DP0 pid=7) ERROR {_at(beyond)} "
                "[core.py:1512] EngineCore encountered a fatal error.",
            ]
        )
        events = place_events(parse_events(log), T0.timestamp(), UTC)
        run = s.get(Run, rid)
        assert run is not None
        run.engine_info = {
            **run.engine_info,
            "engine_events": events,
            "engine_events_summary": {
                "total": 3,
                "kept": 3,
                "by_type": {"preemption": 1, "nccl_error": 1, "engine_dead": 1},
                "unplaced": 1,
            },
            "stats_notes": [
                {"line": 9, "timestamp": "01-01 00:00:05", "note": "stats record dropped: cut"}
            ],
        }
    yield {"ids": ids, "run": rid, "mid": float(mid), "beyond": float(beyond)}
    with web_db.begin() as s:
        s.execute(delete(Run).where(Run.experiment_id == ids["experiment_id"]))
        s.execute(delete(Experiment).where(Experiment.id == ids["experiment_id"]))


def test_engine_events_table_and_chart_markers(
    page: Page, live_server: str, with_events: dict[str, Any]
) -> None:
    page.goto(f"{live_server}/runs/{with_events['run']}")
    rows = page.locator("#engine-events-table tbody tr")
    expect(rows).to_have_count(3)
    expect(rows.nth(0)).to_have_attribute("data-type", "preemption")
    expect(rows.nth(0).locator("td").first).to_have_text(f"{with_events['mid']:.1f}")
    expect(rows.nth(1)).to_have_attribute("data-placement", "unplaced")
    expect(rows.nth(1)).to_contain_text(f"unplaced (after {with_events['mid']:.1f})")
    expect(rows.nth(1).locator("td").nth(3)).to_have_text("")  # no tag: no source shown
    expect(rows.nth(2)).to_contain_text("EngineCore_DP0 pid=7")
    expect(page.locator("#event-legend")).to_contain_text("engine_dead (1)")
    expect(page.locator("#stats-notes")).to_contain_text("1 engine stats line not read")
    # the markers: the placed events, and the x axis widened to the one after the samples
    page.wait_for_function(
        "Chart.getChart('chart-kv') && Chart.getChart('chart-kv').data.datasets[0].data.length > 0"
    )
    drawn = page.evaluate("window.vlabEngineEvents.events().map((e) => [e.type, e.t_s])")
    assert drawn == [["preemption", with_events["mid"]], ["engine_dead", with_events["beyond"]]]
    x_max = page.evaluate("Chart.getChart('chart-kv').scales.x.max")
    assert x_max >= with_events["beyond"]
    page.locator("#charts").scroll_into_view_if_needed()
    screenshot(page, "run-engine-events")


def test_run_without_stored_events_says_unknown(
    page: Page, live_server: str, with_events: dict[str, Any]
) -> None:
    page.goto(f"{live_server}/runs/{with_events['ids']['runs']['baseline#0']}")
    expect(page.locator("#events-unknown")).to_contain_text('unknown, not "none"')
    assert page.evaluate("window.vlabEngineEvents.events().length") == 0
