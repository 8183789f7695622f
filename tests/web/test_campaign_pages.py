"""The campaign pages in a real Chromium: the list, and a finished campaign's page (the
path as a chart with its adopted, inert and worse candidates, the path and candidates
tables with verdicts, reasons and links to the runs, the confirmation, where the wall time
went, a run lost to the infrastructure and measured again, the final ``vllm serve`` line),
the navigation link and the 404 page.

The campaigns are made through the service functions (``accept_campaign``,
:func:`orchestrator.tuning.service.advance`) with **fake recorded run metrics** (the
test double of ``tests/orchestrator/tuning/test_campaign_service.py``: each queued run's
objective written from a known surface: prefix caching x1.30, max_num_seqs 64 x0.90, 256
inert; each run given timings, and one run lost the way the dispatcher ends a lost run,
``fail_lost``). They live in a database and a server of this module's own, so the other dashboard
tests' counts stay exact.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import create_engine
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from orchestrator.core.db import normalize_url, unit_of_work, upgrade_to_head
from orchestrator.core.repositories import CampaignRepository, RunRepository
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus
from orchestrator.dispatch.lost_runs import fail_lost
from orchestrator.tuning import service
from orchestrator.tuning.intake import accept_campaign
from tests.api.livehttp import live_server as serve
from tests.conftest import fresh_database
from tests.orchestrator.tuning.test_campaign_service import (
    campaign_doc,
    record_fake_result,
    surface,
)
from tests.web.conftest import allow_console_error, web_settings

#: The run of the finished campaign that is lost once (and measured again).
LOST = "r1.c1.engine_args.max_num_seqs=256"
#: The run of the finished campaign whose objective a finding flags once (a warm prefix
#: cache: measured again, not lost).
FLAGGED = "r1.c1.engine_args.max_num_seqs=64"


@pytest.fixture(scope="module")
def campaign_site(
    server_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """A fresh database with a finished campaign and a queued one, served by uvicorn."""
    settings = web_settings(tmp_path_factory.mktemp("campaign-web-home"))
    with fresh_database(server_url) as url:
        upgrade_to_head(url)
        engine = create_engine(normalize_url(url))
        factory = sessionmaker(bind=engine, expire_on_commit=False)
        done = _finished_campaign(factory, settings)
        with unit_of_work(factory) as s:
            queued = accept_campaign(s, settings, campaign_doc(name="web waiting")).id
            auto = accept_campaign(s, settings, campaign_doc(name="web auto", space="auto")).id
        try:
            with serve(create_app(settings, factory)) as base:
                yield {"base": base, "done": done, "queued": queued, "auto": auto}
        finally:
            engine.dispose()


def _finished_campaign(factory: sessionmaker[Session], settings: Settings) -> str:
    with unit_of_work(factory) as s:
        cid = accept_campaign(s, settings, campaign_doc(name="web tune")).id
    for _ in range(200):
        with unit_of_work(factory) as s:
            row = service.advance(s, settings, cid)
            assert row is not None
            if row.status not in ("queued", "running"):
                assert row.status == "succeeded", row.status_reason
                return cid
        _finish_with_costs(factory, cid)
    raise AssertionError("the campaign did not end")


def _finish_with_costs(factory: sessionmaker[Session], cid: str) -> None:
    """Fake results for the queued runs, each with timings (10 s start-up on every other
    run, 5 s measured); :data:`LOST` lost to the infrastructure, :data:`FLAGGED` measured
    on a warm prefix cache."""
    with unit_of_work(factory) as s:
        repo = RunRepository(s)
        for run in CampaignRepository(s).runs(cid):
            if run.status != "queued":
                continue
            if run.campaign_label == LOST:
                repo.transition(run, RunStatus.PREPARING)
                fail_lost(repo, run, "orchestrator restarted and the run's supervisor is gone")
                continue
            record_fake_result(s, run, surface(run))
            starts = run.sequence % 2 == 0
            run.engine_info = {"server_reused": not starts}
            if run.campaign_label == FLAGGED:
                run.engine_info["cache_contamination"] = {"status": "contaminated"}
            run.timings = {"startup_s": 10.0 if starts else 0.0, "measure_s": 5.0}


def test_the_list_links_each_campaign(page: Page, campaign_site: dict[str, Any]) -> None:
    base = campaign_site["base"]
    page.goto(base + "/")
    page.locator("header nav a", has_text="Campaigns").click()
    expect(page).to_have_url(base + "/campaigns")
    expect(page.locator("#total")).to_have_text("3 campaigns")
    done = page.locator(f"#campaign-{campaign_site['done']}")
    expect(done.locator(".status")).to_have_text("succeeded")
    expect(done).to_contain_text("output_throughput")
    expect(page.locator(f"#campaign-{campaign_site['queued']} .status")).to_have_text("queued")
    done.locator("a", has_text="web tune").click()
    expect(page).to_have_url(f"{base}/campaigns/{campaign_site['done']}")
    expect(page.locator("#campaign-name")).to_have_text("web tune")


def test_a_finished_campaign_shows_its_path_verdicts_and_runs(
    page: Page, campaign_site: dict[str, Any]
) -> None:
    base = campaign_site["base"]
    page.goto(f"{base}/campaigns/{campaign_site['done']}")
    expect(page.locator("#status")).to_have_text("succeeded")
    expect(page.locator("#phase")).to_have_text("done")
    # the path: one adopted step, prefix caching false -> true, about +30 % with its interval
    steps = page.locator("#path tr.step")
    expect(steps).to_have_count(1)
    expect(steps.locator(".variable")).to_have_text("engine_args.enable_prefix_caching")
    expect(steps.locator(".change")).to_have_text("false → true")
    pct = float(steps.locator(".gain").get_attribute("data-pct") or "nan")
    assert 25 < pct < 35
    expect(steps.locator(".gain")).to_contain_text("[")
    # the chart: a bar per decided candidate with its interval, coloured by outcome
    chart = page.evaluate(
        """() => { const c = Chart.getChart('path-chart'); const d = c.data.datasets[0];
        return {labels: c.data.labels, data: d.data, colors: d.backgroundColor}; }"""
    )
    bars = json.loads(page.locator("#chart-data").text_content() or "{}")["bars"]
    assert len(chart["labels"]) == len(bars) >= 3
    outcomes = [b["outcome"] for b in bars]
    assert outcomes[0] == "adopted" and "inert" in outcomes and "worse" in outcomes
    first = chart["data"][0]
    assert first["yMin"] < first["y"] < first["yMax"] and 25 < first["y"] < 35
    assert chart["colors"][0] == "#1a7f37"
    assert chart["colors"][outcomes.index("worse")] == "#cf222e"
    # the candidates: verdicts, reasons, and their runs linked
    rows = page.locator("#candidates tr.candidate")
    adopted = page.locator('#candidates tr[data-outcome="adopted"]')
    expect(adopted).to_have_count(1)
    expect(adopted.locator(".change")).to_have_text("false → true")
    worse = page.locator('#candidates tr[data-outcome="worse"]')
    assert worse.count() >= 1
    expect(worse.first.locator(".change")).to_have_text("128 → 64")
    expect(worse.first.locator(".reason")).to_contain_text("worse")
    inert = page.locator('#candidates tr[data-outcome="inert"]')
    assert inert.count() >= 1
    expect(inert.first.locator(".reason")).to_contain_text("equivalent within")
    expect(page.locator('#candidates tr[data-outcome="skipped"] .reason').first).to_contain_text(
        "undoes"
    )
    assert rows.count() >= 5
    links = adopted.locator("a.run-link")
    assert links.count() >= 2
    href = links.first.get_attribute("href") or ""
    assert href.startswith("/runs/")
    assert href.removeprefix("/runs/") in campaign_run_ids(campaign_site)
    # the confirmation: measured total vs the product of the step gains
    expect(page.locator("#confirm-total .gain")).to_contain_text("%")
    expect(page.locator("#confirm-steps .gain")).to_contain_text("%")
    expect(page.locator("#confirm-verdict")).to_contain_text("agrees with the path")
    # the final configuration as a vllm serve line
    argv = shlex.split(page.locator("#serve-command").text_content() or "")
    assert argv[:3] == ["vllm", "serve", "tiny"] and "--enable-prefix-caching" in argv
    assert argv[argv.index("--max-num-seqs") + 1] == "128"
    # where the wall time went, and the lost run measured again
    wall = page.locator("#wall-time-table")
    startups = float(wall.locator('tr[data-kind="startup_s"] td.num').first.inner_text())
    measured = float(wall.locator('tr[data-kind="measure_s"] td.num').first.inner_text())
    runs = len(campaign_run_ids(campaign_site))
    assert startups > 0 and startups % 10 == 0 and measured == 5.0 * (runs - 1)
    starts = int((page.locator("#server-starts").inner_text()).split()[0])
    assert starts == startups / 10
    expect(wall.locator('tr[data-kind="elapsed_s"]')).to_contain_text("100%")
    # each run measured again says why: lost to the infrastructure, or a finding flagged it
    lost = page.locator('#lost-runs li[data-kind="lost"]')
    expect(lost).to_have_text(
        "measured again (lost to the infrastructure: orchestrator restarted and the run's "
        f"supervisor is gone): {LOST} → {LOST}.retry1"
    )
    flagged = page.locator('#lost-runs li[data-kind="flagged"]')
    expect(flagged).to_contain_text(
        "measured again (a finding flagged its objective: warm_cache: measured on a warm "
        "prefix cache"
    )
    expect(flagged).to_contain_text(f"{FLAGGED} → {FLAGGED}.retry1")
    expect(page.locator("#lost-runs")).not_to_contain_text("lost to the infrastructure, measured")
    api = f"{campaign_site['base']}/api/v1/campaigns/{campaign_site['done']}"
    reasons = httpx.get(api, timeout=30).json()["retry_reasons"]  # the API says the same
    assert {label: r["kind"] for label, r in reasons.items()} == {
        LOST: "lost",
        FLAGGED: "flagged",
    }
    retry = page.locator('#candidates a.run-link[title^="' + LOST + '.retry1"]')
    expect(retry).to_have_count(1)
    expect(retry).to_contain_text("(retry)")
    # a run link opens the run page
    links.first.click()
    expect(page).to_have_url(base + href)


def campaign_run_ids(site: dict[str, Any]) -> set[str]:
    """The ids of the finished campaign's runs, read over the API."""
    body = httpx.get(f"{site['base']}/api/v1/campaigns/{site['done']}", timeout=30).json()
    return {r["id"] for r in body["runs"]}


def test_a_queued_campaign_and_a_missing_one(page: Page, campaign_site: dict[str, Any]) -> None:
    base = campaign_site["base"]
    page.goto(f"{base}/campaigns/{campaign_site['queued']}")
    expect(page.locator("#status")).to_have_text("queued")
    expect(page.locator("#no-step")).to_contain_text("No step adopted yet")
    expect(page.locator("#chart-empty")).to_be_visible()
    expect(page.locator("#no-confirmation")).to_have_text("Not run yet.")
    expect(page.locator("#space-proposal")).to_have_count(0)  # a space the user listed
    allow_console_error(page, "404")
    resp = page.goto(f"{base}/campaigns/nope")
    assert resp is not None and resp.status == 404
    expect(page.locator("main")).to_contain_text("No campaign nope")


def test_a_space_vlab_proposed_shows_each_variable_in_or_out_and_why(
    page: Page, campaign_site: dict[str, Any]
) -> None:
    """``"space": "auto"``: the page lists every variable vlab considered, the ones in the
    space with their levels, the ones left out with the reason (here max_num_seqs: the
    baseline does not set it and vLLM is not asked in this test)."""
    page.goto(f"{campaign_site['base']}/campaigns/{campaign_site['auto']}")
    rows = page.locator("#space-proposal tbody tr")
    expect(rows.first).to_be_visible()
    apc = page.locator("#space-proposal tr.in", has_text="engine_args.enable_prefix_caching")
    expect(apc).to_contain_text("false, true")
    seqs = page.locator("#space-proposal tr.out", has_text="engine_args.max_num_seqs")
    expect(seqs).to_contain_text("its starting value is unknown: set it in the baseline")
    expect(seqs.locator("td").nth(2)).to_have_text("–")
