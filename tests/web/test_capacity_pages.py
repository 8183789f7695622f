"""Capacity under SLOs on the dashboard (issue #15), in a real Chromium: the run page's
result in words, latency-vs-load charts with the SLO line and steps table (a found
search and an uncertain one, which shows no number), and the experiment page's
capacity column, curves and Pareto chart with the non-dominated runs marked."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.models import Experiment, Run
from tests.web.conftest import screenshot
from tests.web.seed import capacity_runs


@pytest.fixture(scope="module")
def cap_data(web_db: sessionmaker[Session]) -> Iterator[dict[str, Any]]:
    with web_db.begin() as s:
        data = capacity_runs(s, name=f"capacity-{uuid.uuid4().hex[:8]}")
    yield data
    with web_db.begin() as s:
        s.execute(delete(Run).where(Run.experiment_id == data["experiment_id"]))
        s.execute(delete(Experiment).where(Experiment.id == data["experiment_id"]))


def _chart(page: Page, canvas_id: str) -> list[dict[str, Any]]:
    """The datasets of a chart: ``[{label, type, points: [{x, y, yMin, yMax}], styles}]``
    once it has been drawn."""
    page.wait_for_function(
        "id => { const el = document.getElementById(id); return el && Chart.getChart(el); }",
        arg=canvas_id,
    )
    return list(
        page.evaluate(
            """id => Chart.getChart(document.getElementById(id)).data.datasets.map(d => ({
                 label: d.label, type: d.type || null,
                 points: d.data.map(p => ({x: p.x, y: p.y, yMin: p.yMin ?? null,
                                           yMax: p.yMax ?? null, name: p.name ?? null})),
                 styles: Array.isArray(d.pointStyle) ? d.pointStyle : [d.pointStyle]}))""",
            canvas_id,
        )
    )


def _by_label(datasets: list[dict[str, Any]], label: str) -> dict[str, Any]:
    return next(d for d in datasets if d["label"] == label)


def test_run_page_shows_a_found_capacity(
    page: Page, live_server: str, cap_data: dict[str, Any]
) -> None:
    page.goto(f"{live_server}/runs/{cap_data['runs']['baseline']}")
    card = page.locator("#capacity-card")
    expect(card).to_have_attribute("data-status", "found")
    expect(page.locator("#capacity-value")).to_have_text("2.1 req/s")
    sentence = page.locator("#capacity-sentence")
    expect(sentence).to_contain_text("2.1 req/s (bracket 2.1–2.2 req/s)")
    expect(sentence).to_contain_text("bound by TTFT p99 ≤ 500 ms")
    expect(page.locator("#capacity-binding")).to_have_text("TTFT p99 ≤ 500 ms")
    expect(page.locator("#capacity-objectives")).to_contain_text("TPOT p99 ≤ 50 ms")

    # one chart per objective metric: the checked percentile with its interval as
    # error bars and a marker per verdict, the objective as a horizontal line
    ttft = _chart(page, "chart-capacity-ttft_ms")
    checked = _by_label(ttft, "p99 (SLO checked)")
    steps = cap_data["documents"]["baseline"]["steps"]
    by_load = sorted(steps, key=lambda s: (s["load"], s["index"]))
    assert [p["x"] for p in checked["points"]] == [s["load"] for s in by_load]
    assert [(p["y"], p["yMin"], p["yMax"]) for p in checked["points"]] == [
        (c["value"], c["ci_low"], c["ci_high"])
        for s in by_load
        for c in s["checks"]
        if c["metric"] == "ttft_ms"
    ]
    verdict_style = {"pass": "circle", "fail": "crossRot", "uncertain": "triangle"}
    assert checked["styles"] == [
        verdict_style[c["verdict"]]
        for s in by_load
        for c in s["checks"]
        if c["metric"] == "ttft_ms"
    ]
    slo = _by_label(ttft, "SLO TTFT p99 ≤ 500 ms")
    assert {p["y"] for p in slo["points"]} == {500.0}
    assert slo["points"][0]["x"] == 0 and slo["points"][-1]["x"] >= 8.0
    assert {d["label"] for d in ttft} >= {"p50", "p90"}  # the other percentiles, for context
    bracket = page.evaluate(
        "() => Chart.getChart(document.getElementById('chart-capacity-ttft_ms'))"
        ".options.plugins.capacityBracket"
    )
    assert (bracket["capacity"], bracket["low"], bracket["high"]) == (2.1, 2.1, 2.2)
    tpot = _chart(page, "chart-capacity-tpot_ms")
    assert {p["y"] for p in _by_label(tpot, "SLO TPOT p99 ≤ 50 ms")["points"]} == {50.0}

    # the steps table, in the order measured
    rows = page.locator("#capacity-steps tbody tr")
    expect(rows).to_have_count(len(steps))
    for s in steps:
        row = page.locator(f'#capacity-steps tr[data-step="{s["index"]}"]')
        expect(row).to_have_attribute("data-verdict", s["verdict"])
    boundary = page.locator('#capacity-steps tr[data-step="3"]')
    expect(boundary.locator('td[data-col="load"]')).to_have_text("2.1")
    expect(boundary.locator('td[data-col="ttft_ms p99"]')).to_contain_text("430.0")
    expect(boundary.locator('td[data-col="ttft_ms p99"]')).to_contain_text("[390.0, 470.0]")
    expect(boundary.locator('td[data-col="ttft_ms p99"]')).to_have_class(re.compile("pass"))
    expect(boundary.locator('td[data-col="ttft_ms p50"]')).to_have_text("193.5")
    expect(boundary.locator('td[data-col="goodput"]')).to_contain_text("100.0 %")
    expect(boundary.locator('td[data-col="kv"]')).to_have_text("30.0 %")
    saturated = page.locator('#capacity-steps tr[data-step="1"]')
    expect(saturated.locator('td[data-col="waiting"]')).to_have_text("0 → 41 (41)")
    # the seed's documents predate saturation_evidence: a signal, never "server saturated"
    expect(saturated.locator('[data-col="saturated"]')).to_have_text(
        "saturation signal: waiting requests grew through the step (0 -> 41) "
        "(no server evidence stored)"
    )
    expect(saturated.locator('td[data-col="ttft_ms p99"]')).to_have_class(re.compile("fail"))
    page.locator("#capacity").scroll_into_view_if_needed()
    screenshot(page, "run-capacity")


def test_run_page_shows_an_uncertain_search_as_unknown(
    page: Page, live_server: str, cap_data: dict[str, Any]
) -> None:
    page.goto(f"{live_server}/runs/{cap_data['runs']['tp2']}")
    expect(page.locator("#capacity-card")).to_have_attribute("data-status", "uncertain")
    expect(page.locator("#capacity-card")).to_have_attribute("data-found", "false")
    value = page.locator("#capacity-value")
    expect(value).to_have_text("unknown")
    assert not re.search(r"\d", value.inner_text())  # never a number without a found capacity
    expect(page.locator("#capacity-status")).to_have_text("unknown: uncertain")
    sentence = page.locator("#capacity-sentence")
    expect(sentence).to_contain_text("Unknown: uncertain at 4.5 req/s")
    expect(sentence).to_contain_text("TTFT p99 ≤ 500 ms straddles its objective")
    expect(sentence).to_contain_text("no capacity is reported")
    expect(page.locator("#capacity-binding")).to_have_count(0)
    expect(page.locator("#capacity-note")).to_contain_text("straddled 500 ms")
    # no capacity line or bracket on the chart; the straddling steps marked uncertain
    ttft = _chart(page, "chart-capacity-ttft_ms")
    bracket = page.evaluate(
        "() => Chart.getChart(document.getElementById('chart-capacity-ttft_ms'))"
        ".options.plugins.capacityBracket"
    )
    assert bracket.get("capacity") is None
    checked = _by_label(ttft, "p99 (SLO checked)")
    assert checked["styles"].count("triangle") == 2
    expect(page.locator('#capacity-steps tr[data-verdict="uncertain"]')).to_have_count(2)
    expect(
        page.locator('#capacity-steps tr[data-step="2"] td[data-col="ttft_ms p99"]')
    ).to_have_class(re.compile("uncertain"))


def test_run_without_a_search_has_no_capacity_section(
    page: Page, live_server: str, seeded: dict[str, Any]
) -> None:
    page.goto(f"{live_server}/runs/{seeded['real']['runs']['apc-on#0']}")
    expect(page.locator("#summary")).to_be_visible()
    expect(page.locator("#capacity-card")).to_have_count(0)
    expect(page.locator("#capacity-data")).to_have_count(0)
    expect(page.locator(".toc a[href='#capacity']")).to_have_count(0)


def test_experiment_page_shows_capacity_curves_and_pareto(
    page: Page, live_server: str, cap_data: dict[str, Any]
) -> None:
    ids = cap_data["runs"]
    page.goto(f"{live_server}/experiments/{cap_data['experiment_id']}")

    # Pareto: a point per run; baseline (40, 105) and apc-on (36, 200) come from their
    # capacity steps and are non-dominated; tp2 (25, 190) from its metrics is dominated
    datasets = _chart(page, "chart-pareto")
    frontier = _by_label(datasets, "Pareto frontier (non-dominated)")
    assert [(p["name"], p["x"], p["y"]) for p in frontier["points"]] == [
        ("apc-on #1", 36.0, 200.0),
        ("baseline #1", 40.0, 105.0),
    ]
    points = {
        p["name"]: (p["x"], p["y"])
        for d in datasets
        if d["label"] in ("baseline", "apc-on", "tp2")
        for p in d["points"]
    }
    assert points == {
        "baseline #1": (40.0, 105.0),
        "apc-on #1": (36.0, 200.0),
        "tp2 #1": (25.0, 190.0),
    }
    assert _by_label(datasets, "tp2")["styles"] == ["circle"]
    assert _by_label(datasets, "apc-on")["styles"] == ["rectRot"]
    table = page.locator("#pareto-table")
    expect(table.locator(f'tr[data-run-id="{ids["baseline"]}"]')).to_have_attribute(
        "data-frontier", "true"
    )
    expect(table.locator(f'tr[data-run-id="{ids["apc-on"]}"]')).to_contain_text("non-dominated")
    tp2 = table.locator(f'tr[data-run-id="{ids["tp2"]}"]')
    expect(tp2).to_have_attribute("data-frontier", "false")
    expect(tp2).to_contain_text("run metrics")
    expect(table.locator(f'tr[data-run-id="{ids["apc-on"]}"]')).to_contain_text(
        "capacity boundary step"
    )

    # the runs' latency-vs-load curves: one chart per objective, a series per run and
    # the objective's line
    expect(page.locator("#capacity-curves .chart")).to_have_count(2)
    curve = _chart(page, "chart-curve-0")
    assert {d["label"] for d in curve} == {
        "baseline #1",
        "apc-on #1",
        "tp2 #1",
        "SLO TTFT p99 ≤ 500 ms",
    }

    # the ladder's capacity column (the comparison's per-variant capacity member)
    expect(page.locator('#ladder th[data-metric="capacity"]')).to_have_count(1)
    apc = page.locator('#ladder tr[data-variant="apc-on"] td[data-metric="capacity"]')
    expect(apc).to_have_attribute("data-verdict", "higher")
    expect(apc.locator(".val")).to_contain_text("4.20 vs 2.10")
    expect(page.locator('#ladder th[data-metric="capacity"]')).to_contain_text("requests/s")
    expect(apc.locator(".ratio")).to_contain_text("2.00×")
    tp2_cell = page.locator('#ladder tr[data-variant="tp2"] td[data-metric="capacity"]')
    expect(tp2_cell).to_have_attribute("data-verdict", "unknown")
    # uncertain between 1 and 8 (its bracket so far) against 2.1: the ratio 0.45x to 3.81x
    # does not exclude 1, so unknown, with what the search did show
    expect(tp2_cell.locator(".val")).to_contain_text("between 1 and 8 vs 2.10")
    expect(page.locator('#ladder tr[data-notes-for="tp2"]')).to_contain_text(
        "capacity unknown: the ratio is 0.45x to 3.81x, which does not exclude 1"
    )
    base = page.locator('#ladder tr[data-variant="baseline"] td[data-metric="capacity"]')
    expect(base).to_have_attribute("data-verdict", "reference")
    expect(base.locator(".val")).to_contain_text("2.10")
    page.locator("#capacity").scroll_into_view_if_needed()
    screenshot(page, "experiment-capacity")


def test_experiment_without_capacity_has_no_capacity_column_but_a_pareto_chart(
    page: Page, live_server: str, seeded: dict[str, Any]
) -> None:
    page.goto(f"{live_server}/experiments/{seeded['real']['experiment_id']}")
    expect(page.locator('#ladder th[data-metric="capacity"]')).to_have_count(0)
    expect(page.locator("#capacity-curves")).to_have_count(0)
    datasets = _chart(page, "chart-pareto")
    points = [p for d in datasets if d["label"] in ("baseline", "apc-on") for p in d["points"]]
    assert len(points) == 4  # two repeats of each level
    expect(page.locator("#pareto-table tbody tr")).to_have_count(4)
    assert len(_by_label(datasets, "Pareto frontier (non-dominated)")["points"]) >= 1
