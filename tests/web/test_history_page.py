"""The run history page in a real Chromium: filters, sorting, pagination, selection."""

from __future__ import annotations

from typing import Any

from playwright.sync_api import Page, expect
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.models import Experiment, Run
from tests.web.conftest import allow_console_error, screenshot

# seeded: 2 real experiments x 4 runs + 30 bulk experiments x 4 runs ("bulk-model");
# other page tests may add runs of their own, so totals are read from the database and
# filter counts are scoped to the bulk runs.


def _column(page: Page, index: int) -> list[str]:
    return page.locator(f"#rows tr td:nth-child({index})").all_inner_texts()


def test_history_lists_runs_newest_first_with_metrics(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    with web_db() as s:
        total = s.scalar(select(func.count()).select_from(Run))
        newest = s.scalar(
            select(Experiment.name)
            .join(Run, Run.experiment_id == Experiment.id)
            .order_by(Experiment.created_at.desc(), Experiment.id.desc(), Run.sequence, Run.id)
            .limit(1)
        )
    assert total is not None and total >= 128
    page.goto(live_server + "/")
    expect(page.locator("#total")).to_have_text(f"{total:,} runs")
    expect(page.locator("#rows tr")).to_have_count(50)
    # the newest experiment first, its runs in start order (the real demo experiment
    # unless another test added runs since)
    first = page.locator("#rows tr").first
    expect(first.locator("td").nth(2)).to_have_text(newest or "")
    page.goto(live_server + "/?experiment=demo+apc&sort=submitted")
    first = page.locator("#rows tr").first
    expect(first.locator("td").nth(2)).to_have_text("demo apc")
    # the hit rate: measured with prefix caching on, "off" (not a blank) without it
    hit = {
        r.locator("td").nth(1).inner_text().split()[0]: r.locator("td").nth(12).inner_text()
        for r in page.locator("#rows tr").all()
    }
    assert hit["baseline"] == "off" and hit["apc-on"] == "90.2 %"
    # every run is numbered from 1, as the run page, the CLI and MLflow number it
    names = [r.locator("td").nth(1).inner_text() for r in page.locator("#rows tr").all()]
    assert "baseline #1" in names, names
    ttft = first.locator("td").nth(8).inner_text()
    assert ttft != "–" and float(ttft.replace(",", "")) > 0
    screenshot(page, "history")


def test_filter_by_status_engine_argument_and_experiment(page: Page, live_server: str) -> None:
    page.goto(live_server + "/")
    page.select_option("select[name=model]", "bulk-model")
    page.select_option("select[name=status]", "failed")
    page.click("button[type=submit]")
    # bulk run k (0..119) failed when k % 7 == 6: 17 runs
    expect(page.locator("#total")).to_have_text("17 runs")
    assert set(_column(page, 6)) == {"failed"}
    page.select_option("select[name=status]", "cancelled")
    page.click("button[type=submit]")
    expect(page.locator("#total")).to_have_text("0 runs")
    expect(page.locator("#rows")).to_contain_text("No runs match")

    page.goto(live_server + "/")
    page.fill("input[name=engine_arg]", "enable_prefix_caching=true")
    page.fill("input[name=experiment]", "bulk-0000")
    page.click("button[type=submit]")
    # bulk-00000 .. bulk-00009: runs 1 and 3 have APC on -> 20 runs
    expect(page.locator("#total")).to_have_text("20 runs")
    assert set(_column(page, 5)) == {"enable_prefix_caching = true"}
    assert all(name.startswith("bulk-0000") for name in _column(page, 3))


def test_filter_by_model_and_date_range(page: Page, live_server: str) -> None:
    page.goto(live_server + "/")
    page.select_option("select[name=model]", "bulk-model")
    page.fill("input[name=since]", "2026-01-01")
    page.fill("input[name=until]", "2026-01-01")
    page.click("button[type=submit]")
    expect(page.locator("#total")).to_have_text("120 runs")
    page.fill("input[name=until]", "2025-12-31")
    page.fill("input[name=since]", "2025-12-01")
    page.click("button[type=submit]")
    expect(page.locator("#total")).to_have_text("0 runs")


def test_sorting_by_a_metric_both_ways(page: Page, live_server: str) -> None:
    page.goto(live_server + "/?model=bulk-model")
    page.click("th[data-sort=ttft_p50] a")
    expect(page.locator("th[data-sort=ttft_p50]")).to_have_attribute("aria-sort", "descending")
    values = [float(v) for v in _column(page, 9)]
    assert values == sorted(values, reverse=True) and len(values) == 50
    assert values[0] == 13.0  # run 3 of bulk-00029: 10 + 3 + 0.029 -> 13.0 shown to 1 decimal
    page.click("th[data-sort=ttft_p50] a")
    expect(page.locator("th[data-sort=ttft_p50]")).to_have_attribute("aria-sort", "ascending")
    values = [float(v) for v in _column(page, 9)]
    assert values == sorted(values) and values[0] == 10.0


def test_pagination_is_on_the_server(page: Page, live_server: str) -> None:
    page.goto(live_server + "/?model=bulk-model&per_page=25&sort=experiment&dir=asc")
    expect(page.locator("text=page 1 of 5")).to_be_visible()
    first_page = _column(page, 3)
    page.click("a[rel=next]")
    expect(page.locator("text=page 2 of 5")).to_be_visible()
    expect(page.locator("#rows tr")).to_have_count(25)
    assert _column(page, 3) != first_page
    assert _column(page, 3)[0] == "bulk-00006"  # 6 experiments x 4 runs = 24 on page 1, then 1


def test_bad_filter_is_a_clear_error(page: Page, live_server: str) -> None:
    allow_console_error(page, "status of 422")
    response = page.goto(live_server + "/?engine_arg=novalue&since=yesterday")
    assert response is not None and response.status == 422
    expect(page.locator("p.error")).to_contain_text("must")
    # no unfiltered table under the error: it would look like a filtered result
    expect(page.locator("#total")).to_have_text("0 runs")
    expect(page.locator("#rows")).to_contain_text("Fix the filter above")


def test_page_past_the_end_and_the_apis_order_name(page: Page, live_server: str) -> None:
    page.goto(live_server + "/?model=bulk-model&page=99")
    expect(page.locator("#rows")).to_contain_text("Page 99 is past the last page (3)")
    page.click("#rows a")
    expect(page.locator("#rows tr")).to_have_count(50)
    page.goto(live_server + "/?model=bulk-model&sort=ttft_p50&order=asc")
    expect(page.locator("th[data-sort=ttft_p50]")).to_have_attribute("aria-sort", "ascending")


def test_selection_survives_paging_and_opens_compare(page: Page, live_server: str) -> None:
    page.goto(live_server + "/?model=bulk-model&per_page=25")
    page.locator("#rows input.pick").nth(0).check()
    page.click("a[rel=next]")
    page.locator("#rows input.pick").nth(0).check()
    expect(page.locator("#compare-selected")).to_have_text("Compare selected (2)")
    page.click("#compare-selected")
    page.wait_for_url("**/compare?run=*")
    assert page.url.count("run=") == 2
