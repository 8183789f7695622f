"""The compare page in a real Chromium: differing settings, deltas with intervals, chart, scale."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlencode

import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.analysis.compare import MetricComparison, RunData, compare_variant
from orchestrator.analysis.service import runs_as_data
from orchestrator.core.models import Experiment, Run
from tests.web.conftest import allow_console_error, screenshot

KEY_METRICS = (
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "median_e2el_ms",
    "output_throughput",
    "request_throughput",
    "prefix_cache_hit_rate",
)


def _url(base: str, ids: list[str], **extra: str) -> str:
    return base + "/compare?" + urlencode([("run", i) for i in ids] + list(extra.items()))


def _run_data(web_db: sessionmaker[Session], ids: list[str]) -> dict[str, RunData]:
    with web_db() as s:
        runs = list(s.scalars(select(Run).where(Run.id.in_(ids))))
        groups = runs_as_data(s, runs)
    return {d.run_id: d for group in groups.values() for d in group}


def _cell(page: Page, run_id: str, metric: str) -> Any:
    return page.locator(f'#deltas tr[data-run-id="{run_id}"] td[data-metric="{metric}"]')


def _point(page: Page, run_id: str, metric: str) -> dict[str, Any]:
    """The run's entry for ``metric`` in the page's embedded chart data (#compare-data)."""
    doc = json.loads(page.locator("#compare-data").text_content() or "{}")
    index = [r["id"] for r in doc["runs"]].index(run_id)
    point: dict[str, Any] = doc["values"][metric][index]
    return point


def _bulk_ids(web_db: sessionmaker[Session], experiment_ids: list[str]) -> list[str]:
    with web_db() as s:
        return list(
            s.scalars(
                select(Run.id)
                .join(Experiment, Run.experiment_id == Experiment.id)
                .where(Run.experiment_id.in_(experiment_ids))
                .order_by(Experiment.name, Run.position)
            )
        )


def test_demo_pair_shows_only_the_settings_that_differ(
    page: Page, live_server: str, seeded: dict[str, Any]
) -> None:
    runs = seeded["real"]["runs"]
    base, apc = runs["baseline#0"], runs["apc-on#0"]
    page.goto(_url(live_server, [base, apc]))
    keys = page.locator("#settings thead th[data-key]").evaluate_all(
        "ths => ths.map(th => th.dataset.key)"
    )
    # APC off vs on is the only change between the two variants of the demo experiment
    assert keys == ["engine_args.enable_prefix_caching"]
    col = page.locator("#settings tbody tr td.setting")
    assert col.all_inner_texts() == ["false", "true"]
    # the APC-on row's value differs from the reference (the baseline): highlighted
    expect(page.locator(f'#settings tr[data-run-id="{apc}"] td.setting')).to_have_class(
        "setting changed"
    )
    expect(page.locator(f'#settings tr[data-run-id="{base}"]')).to_contain_text("reference")
    # model_id is identical: counted and listed, not a column
    identical = page.locator("#identical tbody tr")
    n_identical = identical.count()
    expect(page.locator("#identical-count")).to_have_text(
        f"{n_identical} settings identical across the 2 runs."
    )
    expect(page.locator("#settings-title")).to_have_text(
        f"Settings that differ (1 of {n_identical + 1})"
    )
    page.click("#identical summary")
    model_row = page.locator('#identical tr[data-key="model_id"]')
    expect(model_row).to_be_visible()
    expect(model_row.locator("td").nth(1)).to_have_text('"small"')
    for key in ("experiment", "workload.prefix_tokens", "layout.tensor_parallel_size", "seed"):
        expect(page.locator(f'#identical tr[data-key="{key}"]')).to_have_count(1)
    apc_row = page.locator('#identical tr[data-key="engine_args.enable_prefix_caching"]')
    expect(apc_row).to_have_count(0)


def test_ratio_and_verdict_cells_agree_with_compare_variant(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    runs = seeded["real"]["runs"]
    base, apc = runs["baseline#0"], runs["apc-on#0"]
    page.goto(_url(live_server, [base, apc]))
    n_boot = int(page.locator("#n-boot").get_attribute("data-n-boot") or "0")
    assert n_boot == 2000  # one comparison: the full bootstrap, no reduction note
    expect(page.locator("#n-boot-reduced")).to_have_count(0)

    data = _run_data(web_db, [base, apc])
    comps: dict[str, MetricComparison] = {
        c.metric: c for c in compare_variant([data[apc]], [data[base]], n_boot=n_boot, seed=0)
    }
    checked = 0
    for metric in KEY_METRICS:
        cell = _cell(page, apc, metric)
        comp = comps.get(metric)
        if comp is None:
            continue
        checked += 1
        point = _point(page, apc, metric)
        assert point["v"] == pytest.approx(comp.variant)
        if comp.verdict == "not applicable":
            # the hit rate with APC off: n/a on the reference, never 0; no ratio, no verdict
            assert metric == "prefix_cache_hit_rate" and comp.reference is None
            assert point["verdict"] == cell.get_attribute("data-verdict") == comp.verdict
            expect(cell.locator(".vd")).to_have_text("not compared: n/a")
            expect(cell.locator(".v")).to_have_text(f"{(comp.variant or 0) * 100:.1f} %")
            expect(_cell(page, base, metric).locator(".v")).to_have_text("n/a (off)")
            expect(_cell(page, base, metric).locator(".vd")).to_have_text("reference")
            continue
        assert point["verdict"] == cell.get_attribute("data-verdict") == comp.verdict
        expect(cell.locator(".vd")).to_have_text(comp.verdict)
        if comp.ratio is not None:
            assert point["ratio"] == pytest.approx(comp.ratio)
            text = f"×{comp.ratio:.2f}"
            if comp.ci_low is not None and comp.ci_high is not None:
                assert comp.ci_of == "ratio"
                text += f" [{comp.ci_low:.2f}, {comp.ci_high:.2f}]"
                assert point["ci_low"] == pytest.approx(comp.ci_low)
                assert point["ci_high"] == pytest.approx(comp.ci_high)
            expect(cell.locator(".d")).to_have_text(text)
        # the reference's own value is the comparison's reference value
        ref_cell = _cell(page, base, metric)
        assert _point(page, base, metric)["v"] == pytest.approx(comp.reference)
        expect(ref_cell.locator(".vd")).to_have_text("reference")
    assert checked == len(KEY_METRICS)
    # with APC on, TTFT drops clearly on this data: a "better" verdict with its CI below 1
    assert comps["median_ttft_ms"].verdict == "better"
    expect(_cell(page, apc, "median_ttft_ms").locator(".vd")).to_have_class("vd better")
    # APC off has no hit rate (never a 0 that compares): no ratio, no difference, no verdict
    hit = comps["prefix_cache_hit_rate"]
    assert hit.verdict == "not applicable" and hit.not_applicable == {"reference": "off"}
    assert hit.ratio is None and hit.difference is None and hit.ci_low is None


def test_chart_has_one_bar_per_run_with_intervals(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    runs = seeded["real"]["runs"]
    ids = [runs["baseline#0"], runs["apc-on#0"], runs["baseline#1"], runs["apc-on#1"]]
    page.goto(_url(live_server, ids, metric="median_e2el_ms"))
    expect(page.locator("#metric")).to_have_value("median_e2el_ms")
    n_boot = int(page.locator("#n-boot").get_attribute("data-n-boot") or "0")
    data = _run_data(web_db, ids)

    def chart_data() -> Any:
        return page.evaluate(
            """() => {
              const c = Chart.getChart(document.getElementById('chart'));
              return {type: c.config.type, labels: c.data.labels,
                      data: c.data.datasets.map(d => d.data), title: c.options.scales.y.title.text};
            }"""
        )

    def expected(metric: str) -> list[MetricComparison]:
        """Each non-reference run vs the reference (the first run), as the page computes."""
        out = []
        for run_id in ids[1:]:
            comps = compare_variant([data[run_id]], [data[ids[0]]], n_boot=n_boot, seed=0)
            out.append(next(c for c in comps if c.metric == metric))
        return out

    got = chart_data()
    assert got["type"] == "barWithErrorBars"
    assert got["labels"] == [
        "baseline (repeat 1)",
        "apc-on (repeat 1)",
        "baseline (repeat 2)",
        "apc-on (repeat 2)",
    ]
    assert len(got["data"]) == 1 and len(got["data"][0]) == 4
    assert got["title"] == "E2EL p50 (ms)"
    bars = got["data"][0]
    comps = expected("median_e2el_ms")
    # the reference bar: its value, no error bar
    assert bars[0]["y"] == pytest.approx(comps[0].reference)
    assert bars[0]["yMin"] == bars[0]["yMax"] == bars[0]["y"]
    for bar, comp, run_id in zip(bars[1:], comps, ids[1:], strict=True):
        assert comp.ci_of == "ratio" and comp.ci_low is not None and comp.ci_high is not None
        assert bar["y"] == pytest.approx(comp.variant)
        assert bar["yMin"] == pytest.approx(comp.reference * comp.ci_low)
        assert bar["yMax"] == pytest.approx(comp.reference * comp.ci_high)
        assert bar["yMin"] <= bar["y"] <= bar["yMax"]
        shown = _cell(page, run_id, "median_e2el_ms").locator(".v").inner_text()
        assert shown == f"{comp.variant:,.1f}"

    # the tooltip of a bar names the run, its ratio with the CI and the verdict
    x, y = page.evaluate(
        """() => { const c = Chart.getChart(document.getElementById('chart'));
                   const bar = c.getDatasetMeta(0).data[1]; return [bar.x, bar.y + 5]; }"""
    )
    page.locator("#chart").hover(position={"x": x, "y": y})
    tooltip = page.evaluate(
        "() => Chart.getChart(document.getElementById('chart')).tooltip.body.flatMap(b => b.lines)"
    )
    assert tooltip[0] == f"E2EL p50: {comps[0].variant:,.1f} ms"
    assert (
        tooltip[1] == f"ratio ×{comps[0].ratio:.2f} [{comps[0].ci_low:.2f}, {comps[0].ci_high:.2f}]"
    )
    assert tooltip[-1] == f"verdict: {comps[0].verdict}"
    screenshot(page, "compare")

    page.select_option("#metric", "output_throughput")
    got = chart_data()
    assert got["title"] == "Output throughput (tok/s)"
    values = [p["y"] for p in got["data"][0]]
    assert values == pytest.approx([data[i].metrics["output_throughput"] for i in ids])
    assert "metric=output_throughput" in page.url  # kept for a reload / a shared link


def test_choosing_another_reference(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    runs = seeded["real"]["runs"]
    base, apc = runs["baseline#0"], runs["apc-on#0"]
    page.goto(_url(live_server, [base, apc]))
    with page.expect_navigation():
        page.select_option("#ref-select", apc)
    assert f"ref={apc}" in page.url
    expect(page.locator(f'#deltas tr[data-run-id="{apc}"]')).to_contain_text("reference")
    n_boot = int(page.locator("#n-boot").get_attribute("data-n-boot") or "0")
    data = _run_data(web_db, [base, apc])
    comps = {c.metric: c for c in compare_variant([data[base]], [data[apc]], n_boot=n_boot, seed=0)}
    ttft = comps["median_ttft_ms"]
    assert ttft.verdict == "worse"  # APC off is slower to the first token than APC on
    cell = _cell(page, base, "median_ttft_ms")
    assert cell.get_attribute("data-verdict") == "worse"
    assert _point(page, base, "median_ttft_ms")["ratio"] == pytest.approx(ttft.ratio)
    # APC off has no hit rate: n/a, not a fall from 90 % to 0 (APC on is now the reference)
    hit = comps["prefix_cache_hit_rate"]
    assert hit.verdict == "not applicable" and hit.ratio is None and hit.variant is None
    hit_cell = _cell(page, base, "prefix_cache_hit_rate")
    expect(hit_cell.locator(".v")).to_have_text("n/a (off)")
    expect(hit_cell.locator(".vd")).to_have_text("not compared: n/a")
    expect(hit_cell.locator(".d")).to_have_count(0)


def test_120_runs_stay_usable(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    ids = _bulk_ids(web_db, seeded["bulk"])
    assert len(ids) == 120
    t0 = time.perf_counter()
    page.goto(_url(live_server, ids))
    elapsed = time.perf_counter() - t0
    assert elapsed < 15, f"the 120-run compare page took {elapsed:.1f} s"
    expect(page.locator("#settings tbody tr")).to_have_count(120)
    expect(page.locator("#deltas tbody tr")).to_have_count(120)
    keys = page.locator("#settings thead th[data-key]").evaluate_all(
        "ths => ths.map(th => th.dataset.key)"
    )
    # 30 experiments; runs differ in APC and max_num_seqs (64 + i); the rest is identical
    assert keys == ["experiment", "engine_args.enable_prefix_caching", "engine_args.max_num_seqs"]
    # run k failed when k % 7 == 6: 17 runs show their status instead of numbers
    failed = page.locator('#deltas tr[data-status="failed"] td.no-metrics')
    expect(failed).to_have_count(17)
    expect(failed.first).to_contain_text("failed")
    # 102 comparisons: fewer bootstrap draws, and the page says so
    assert page.locator("#n-boot").get_attribute("data-n-boot") == "200"
    expect(page.locator("#n-boot-reduced")).to_contain_text("102 comparisons")
    # no per-request records in these synthetic runs: a point ratio of the stored TTFT p50,
    # run 1 of bulk-00000 (11.0 ms) vs its baseline (10.0 ms)
    cell = _cell(page, ids[1], "median_ttft_ms")
    assert _point(page, ids[1], "median_ttft_ms")["ratio"] == pytest.approx(1.1)
    assert cell.get_attribute("data-source") == "point"
    expect(cell.locator(".vd")).to_have_text("insufficient data")

    # scroll the settings table to its end: its header row stays on screen (sticky)
    scroller = page.locator("#settings-scroll")
    scroller.evaluate("el => { el.scrollTop = el.scrollHeight; }")
    header = page.locator('#settings thead th[data-key="engine_args.max_num_seqs"]')
    expect(header).to_be_in_viewport()
    box_scroller, box_header = scroller.bounding_box(), header.bounding_box()
    assert box_scroller is not None and box_header is not None
    assert abs(box_header["y"] - box_scroller["y"]) < 3
    expect(page.locator("#settings tbody tr").last).to_be_in_viewport()
    scroller.evaluate("el => { el.scrollTop = 0; }")

    n_bars = page.evaluate(
        "() => { const c = Chart.getChart(document.getElementById('chart'));"
        " return [c.data.labels.length, c.data.datasets[0].data.length]; }"
    )
    assert n_bars == [120, 120]


def test_unknown_run_ids_are_named_with_422(
    page: Page, live_server: str, seeded: dict[str, Any]
) -> None:
    allow_console_error(page, "status of 422")
    known = seeded["real"]["runs"]["baseline#0"]
    response = page.goto(_url(live_server, [known, "no-such-run-1", "no-such-run-2"]))
    assert response is not None and response.status == 422
    expect(page.locator("p.error")).to_have_text("Unknown run ids: no-such-run-1, no-such-run-2")
    # the paste form keeps the selection so it can be fixed
    expect(page.locator("#paste-form textarea")).to_have_value(
        f"{known}\nno-such-run-1\nno-such-run-2"
    )


def test_bad_reference_and_too_many_runs_are_422(
    page: Page, live_server: str, seeded: dict[str, Any]
) -> None:
    allow_console_error(page, "status of 422")
    runs = seeded["real"]["runs"]
    response = page.goto(
        _url(live_server, [runs["baseline#0"], runs["apc-on#0"]], ref=runs["baseline#1"])
    )
    assert response is not None and response.status == 422
    expect(page.locator("p.error")).to_contain_text(
        f"Reference run {runs['baseline#1']} is not among the compared runs"
    )
    response = page.goto(_url(live_server, [f"r{i}" for i in range(501)]))
    assert response is not None and response.status == 422
    expect(page.locator("p.error")).to_contain_text("501 runs selected")
    expect(page.locator("p.error")).to_contain_text("at most 500")


def test_empty_state_and_paste_form(page: Page, live_server: str, seeded: dict[str, Any]) -> None:
    runs = seeded["real"]["runs"]
    response = page.goto(live_server + "/compare")
    assert response is not None and response.status == 200
    expect(page.locator("#empty")).to_contain_text("No runs selected")
    expect(page.locator("#empty a[href='/']").first).to_be_visible()
    expect(page.locator("header nav a[aria-current=page]")).to_have_text("Compare")
    expect(page.locator("#stored-selection")).to_be_hidden()

    page.goto(_url(live_server, [runs["apc-on#1"]]))
    expect(page.locator("#empty")).to_contain_text("Only one run selected")
    expect(page.locator("#empty")).to_contain_text("demo apc · apc-on (repeat 2)")

    # paste two ids (one per line) and compare
    page.goto(live_server + "/compare")
    page.fill("#paste-form textarea", f"{runs['baseline#1']}\n{runs['apc-on#1']}\n")
    with page.expect_navigation():
        page.click("#paste-form button[type=submit]")
    assert page.url.count("run=") == 2
    expect(page.locator("#deltas tbody tr")).to_have_count(2)

    # a selection left in the run history is offered on the empty page
    page.evaluate(
        "ids => sessionStorage.setItem('vlab.compare.selection', JSON.stringify(ids))",
        [runs["baseline#0"], runs["apc-on#0"], runs["apc-on#1"]],
    )
    page.goto(live_server + "/compare")
    link = page.locator("#stored-selection a")
    expect(link).to_have_text("Compare your selection from the run history (3 runs)")
    link.click()
    expect(page.locator("#deltas tbody tr")).to_have_count(3)


def test_posted_selection_renders_the_same_page(
    page: Page, live_server: str, seeded: dict[str, Any]
) -> None:
    runs = seeded["real"]["runs"]
    body = urlencode([("run", runs["baseline#0"]), ("run", runs["apc-on#0"])])
    response = page.request.post(
        live_server + "/compare",
        data=body,
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert response.status == 200
    html = response.text()
    assert 'data-key="engine_args.enable_prefix_caching"' in html
    assert html.count('<tr data-run-id="') == 4  # 2 runs x (settings + deltas)


def test_failed_reference_is_explained_not_compared(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    ids = _bulk_ids(web_db, seeded["bulk"])[4:8]  # bulk-00001: run 2 (index 6) failed
    failed = ids[2]
    # the first selected run failed: the first one that succeeded becomes the reference
    page.goto(_url(live_server, [failed, ids[0], ids[1]]))
    expect(page.locator("p.note").first).to_contain_text("the first selected run did not succeed")
    expect(page.locator(f'#deltas tr[data-run-id="{ids[0]}"]')).to_contain_text("reference")
    expect(page.locator(f'#deltas tr[data-run-id="{failed}"] td.no-metrics')).to_have_text("failed")
    # asked for explicitly, a failed reference is kept and the page says why nothing compares
    page.goto(_url(live_server, [failed, ids[0], ids[1]], ref=failed))
    expect(page.locator("#ref-failed")).to_contain_text("did not succeed")
    cell = _cell(page, ids[1], "median_ttft_ms")
    expect(cell.locator(".v")).to_have_text("11.0")
    expect(cell.locator(".vd")).to_have_text("no reference value")
    values = page.evaluate(
        "() => Chart.getChart(document.getElementById('chart')).data.datasets[0].data.map(p => p.y)"
    )
    assert values == [None, pytest.approx(10.001), pytest.approx(11.001)]  # 10 + i + e/1000
