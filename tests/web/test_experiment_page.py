"""The experiment page in a real Chromium: ladder, verdicts, chart with CIs, findings, live."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import delete, insert, update
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.analysis.service import comparison
from orchestrator.core.models import Experiment, Run, RunMetric, RunRequest
from tests.web.conftest import allow_console_error, screenshot
from web.pages.experiment import KEY_METRICS
from web.render import fmt_num, fmt_pct


def _comparison(web_db: sessionmaker[Session], experiment_id: str) -> dict[str, Any]:
    with web_db() as session:
        return comparison(session, experiment_id)


def _chart(page: Page) -> dict[str, Any]:
    data: dict[str, Any] = page.evaluate(
        """() => {
          const c = Chart.getChart(document.getElementById('chart'));
          return {labels: c.data.labels, label: c.data.datasets[0].label,
                  points: c.data.datasets[0].data.map(d => ({y: d.y, yMin: d.yMin, yMax: d.yMax}))};
        }"""
    )
    return data


def _insert_small_experiment(
    web_db: sessionmaker[Session],
    name: str,
    *,
    variant_status: str,
    hit_rates: tuple[float, float],
) -> dict[str, str]:
    """baseline (APC off, succeeded) + apc-on (status ``variant_status``), 1 repeat each,
    12 measured requests per run (APC on: TTFT 40 % lower, E2EL identical)."""
    exp_id = str(uuid.uuid4())
    ids = {"baseline": str(uuid.uuid4()), "apc-on": str(uuid.uuid4())}
    now = datetime.now(UTC)
    variants = [
        {"name": "baseline", "position": 0, "reference": None, "variable": None,
         "variable_paths": [], "changes": {}},
        {"name": "apc-on", "position": 1, "reference": "baseline",
         "variable": "engine_args.enable_prefix_caching",
         "variable_paths": ["engine_args.enable_prefix_caching"],
         "changes": {"engine_args.enable_prefix_caching": True}},
    ]  # fmt: skip
    with web_db.begin() as s:
        s.execute(
            insert(Experiment),
            [
                {
                    "id": exp_id,
                    "name": name,
                    "description": "page test",
                    "spec": {},
                    "model_id": "tiny-test",
                    "model_digest": "a" * 64,
                    "request_list_hash": "b" * 64,
                    "repeats": 1,
                    "variants": variants,
                }
            ],
        )
        for pos, (vname, status, apc) in enumerate(
            (("baseline", "succeeded", False), ("apc-on", variant_status, True))
        ):
            rid = ids[vname]
            s.execute(
                insert(Run),
                [
                    {
                        "id": rid,
                        "experiment_id": exp_id,
                        "name": vname,
                        "position": pos,
                        "sequence": pos,
                        "is_baseline": pos == 0,
                        "reference_run_id": None if pos == 0 else ids["baseline"],
                        "reference_variant": None if pos == 0 else "baseline",
                        "variable": variants[pos]["variable"],
                        "variable_paths": variants[pos]["variable_paths"],
                        "changes": variants[pos]["changes"],
                        "status": status,
                        "progress": {},
                        "created_at": now,
                        "started_at": now + timedelta(seconds=pos),
                        "engine_args": {"enable_prefix_caching": apc},
                        "explicit_engine_args": {"enable_prefix_caching": apc},
                        "layout": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1},
                        "workload": {"num_requests": 12},
                        "model_id": "tiny-test",
                        "model_path": "/models/tiny-test",
                        "model_digest": "a" * 64,
                        "max_model_len": 2048,
                        "seed": 0,
                        "request_list_hash": "b" * 64,
                        "engine_info": {},
                        "timings": {},
                    }
                ],
            )
            ttft = 0.06 if apc else 0.1
            s.execute(
                insert(RunRequest),
                [
                    {
                        "run_id": rid,
                        "seq": i,
                        "request_index": i,
                        "warmup": False,
                        "request_class": None,
                        "success": True,
                        "start_s": float(i),
                        "ttft_s": ttft + 0.001 * i,
                        "tpot_s": 0.01 + 0.0001 * i,
                        "e2el_s": 0.5 + 0.002 * i,
                        "itl_s": [0.01, 0.011],
                        "prompt_tokens": 100,
                        "output_tokens": 16,
                    }
                    for i in range(12)
                ],
            )
            s.execute(
                insert(RunMetric),
                [
                    {"run_id": rid, "name": "output_throughput", "value": 30.0},
                    {"run_id": rid, "name": "prefix_cache_hit_rate", "value": hit_rates[pos]},
                ],
            )
    return {"experiment_id": exp_id, **ids}


@pytest.fixture
def small_experiment(web_db: sessionmaker[Session]) -> Iterator[Callable[..., dict[str, str]]]:
    """Insert small experiments (see :func:`_insert_small_experiment`); delete them after
    the test (the history tests count every run in the shared database)."""
    made: list[str] = []

    def make(name: str, **kwargs: Any) -> dict[str, str]:
        ids = _insert_small_experiment(web_db, name, **kwargs)
        made.append(ids["experiment_id"])
        return ids

    yield make
    with web_db.begin() as s:
        s.execute(delete(Experiment).where(Experiment.id.in_(made)))


def test_real_experiment_header_and_ladder(
    page: Page, live_server: str, seeded: dict[str, Any]
) -> None:
    real = seeded["real"]
    exp_id = real["experiment_id"]
    page.goto(f"{live_server}/experiments/{exp_id}")
    expect(page.locator("#exp-name")).to_have_text("demo apc")
    expect(page.locator("#exp-status")).to_have_text("succeeded")
    expect(page.locator("#exp-description")).to_contain_text("prefix caching")
    expect(page.locator("#exp-repeats")).to_have_text("2")
    expect(page.locator("#exp-runs")).to_have_text("4")
    expect(page.locator("#exp-model")).to_have_text("small")
    expect(page.locator("#export-csv")).to_have_attribute(
        "href", f"/api/v1/experiments/{exp_id}/export?format=csv"
    )
    expect(page.locator("#export-json")).to_have_attribute("href", f"/api/v1/experiments/{exp_id}")
    expect(page.locator("#live")).to_be_hidden()

    # ladder: baseline first, then apc-on; both repeats of each linked, with statuses
    rows = page.locator("#ladder tbody tr[data-variant]")
    expect(rows).to_have_count(2)
    assert [rows.nth(i).get_attribute("data-variant") for i in range(2)] == ["baseline", "apc-on"]
    for i, variant in enumerate(("baseline", "apc-on")):
        links = rows.nth(i).locator("ul.repeats a")
        expect(links).to_have_count(2)
        assert [links.nth(k).get_attribute("href") for k in range(2)] == [
            f"/runs/{real['runs'][f'{variant}#{k}']}" for k in range(2)
        ]
        expect(rows.nth(i).locator("ul.repeats .status")).to_have_text(["succeeded"] * 2)
    apc = rows.nth(1)
    expect(apc.locator("td.change")).to_have_text("enable_prefix_caching:false → true")
    expect(apc.locator("td.ref")).to_have_text("baseline")
    expect(rows.nth(0).locator("td.change")).to_have_text("baseline")
    # the caption names every flag that greys a value, a stalled load generator too
    expect(page.locator("#ladder-section p.muted").first).to_contain_text(
        "(token bursts for TPOT and ITL, a warm prefix cache, a load generator that stalled)"
    )
    screenshot(page, "experiment")


def test_verdict_cells_match_the_comparison(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    exp_id = seeded["real"]["experiment_id"]
    cmp = _comparison(web_db, exp_id)
    page.goto(f"{live_server}/experiments/{exp_id}")
    (apc,) = cmp["variants"]
    assert apc["variant"] == "apc-on" and apc["reference"] == "baseline"
    rows = {m["metric"]: m for m in apc["metrics"]}
    row = page.locator('#ladder tr[data-variant="apc-on"]')
    checked = 0
    for metric, _heading in KEY_METRICS:
        cell = row.locator(f'td[data-metric="{metric}"]')
        m = rows.get(metric)
        if m is None:
            # the reference has no value (APC off: no prefix cache queries -> no hit rate)
            expect(cell.locator(".verdict")).to_have_text("not compared")
            continue
        checked += 1
        fmt = fmt_pct if m["unit"] == "fraction" else fmt_num
        if m["verdict"] == "not applicable":
            # the hit rate: APC off has none (n/a, never 0), so no ratio, no verdict
            assert m["metric"] == "prefix_cache_hit_rate" and m["reference"] is None
            assert m["not_applicable"] == {"reference": "off"} and m["ci_low"] is None
            expect(cell).to_have_attribute("data-verdict", "not applicable")
            expect(cell.locator(".verdict")).to_have_text("not compared: n/a")
            expect(cell.locator(".val")).to_contain_text(f"{fmt(m['variant'])} vs n/a (off)")
            expect(cell.locator(".ratio")).to_have_count(0)
            continue
        assert m["verdict"] != "untrusted"  # the real data's runs carry no flag
        expect(cell.locator(".verdict")).to_have_text(m["verdict"])
        expect(cell).to_have_attribute("data-verdict", m["verdict"])
        expect(cell.locator(".val")).to_contain_text(
            f"{fmt(m['variant'])} vs {fmt(m['reference'])}"
        )
        assert m["ci_of"] == "ratio"
        expect(cell.locator(".ratio")).to_contain_text(
            f"{m['ratio']:.2f}× [{m['ci_low']:.2f}, {m['ci_high']:.2f}]"
        )
    assert checked >= 5
    # the real data: APC on cuts median TTFT clearly (coloured as better)
    assert rows["median_ttft_ms"]["verdict"] == "better"
    verdict = row.locator('td[data-metric="median_ttft_ms"] .verdict')
    assert verdict.evaluate("e => getComputedStyle(e).color") == "rgb(26, 127, 55)"
    # the baseline row is the reference level: its own values, no verdict
    base = page.locator('#ladder tr[data-variant="baseline"] td[data-metric="median_ttft_ms"]')
    expect(base.locator(".verdict")).to_have_text("reference level")
    expect(base.locator(".val")).to_have_text(fmt_num(rows["median_ttft_ms"]["reference"]))


def test_chart_has_one_point_per_level_with_cis_and_follows_the_select(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    exp_id = seeded["real"]["experiment_id"]
    rows = {m["metric"]: m for m in _comparison(web_db, exp_id)["variants"][0]["metrics"]}
    page.goto(f"{live_server}/experiments/{exp_id}")
    expect(page.locator("#metric")).to_have_value("median_ttft_ms")
    data = _chart(page)
    assert data["labels"] == [["baseline"], ["apc-on", "enable_prefix_caching=true"]]
    assert data["label"] == "TTFT p50 (ms)"
    base, apc = data["points"]
    ttft = rows["median_ttft_ms"]
    assert base["y"] == pytest.approx(ttft["reference"])
    assert base["yMin"] < base["y"] < base["yMax"]  # the baseline's own bootstrap interval
    assert apc["y"] == pytest.approx(ttft["variant"])
    assert apc["yMin"] == pytest.approx(ttft["reference"] * ttft["ci_low"])
    assert apc["yMax"] == pytest.approx(ttft["reference"] * ttft["ci_high"])
    expect(page.locator("#chart-empty")).to_be_hidden()

    page.select_option("#metric", "output_throughput")
    page.wait_for_function(
        "() => Chart.getChart(document.getElementById('chart')).data.datasets[0].label"
        " === 'Output token throughput (tok/s)'"
    )
    data = _chart(page)
    thr = rows["output_throughput"]
    assert [p["y"] for p in data["points"]] == [
        pytest.approx(thr["reference"]),
        pytest.approx(thr["variant"]),
    ]
    assert data["points"][1]["yMin"] == pytest.approx(thr["reference"] * thr["ci_low"])

    # hit rate: none on the baseline (APC off: n/a, never 0), apc-on's own value
    # the select offers only metrics some level has: no goodput without SLOs
    offered = page.locator("#metric option").evaluate_all("os => os.map(o => o.value)")
    assert "median_ttft_ms" in offered and "prefix_cache_hit_rate" in offered
    assert "request_goodput" not in offered
    page.select_option("#metric", "prefix_cache_hit_rate")
    page.wait_for_function(
        "() => Chart.getChart(document.getElementById('chart')).data.datasets[0].label"
        " === 'Prefix cache hit rate (%)'"
    )
    base, apc = _chart(page)["points"]
    assert base["y"] is None and 0.5 < apc["y"] <= 1.0


def test_findings_empty_state_on_real_data(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    exp_id = seeded["real"]["experiment_id"]
    assert _comparison(web_db, exp_id)["findings"] == []
    page.goto(f"{live_server}/experiments/{exp_id}")
    expect(page.locator("#no-findings")).to_contain_text("No findings")
    expect(page.locator("#findings li")).to_have_count(0)


def test_findings_are_listed_with_evidence(
    page: Page,
    live_server: str,
    web_db: sessionmaker[Session],
    small_experiment: Callable[..., dict[str, str]],
) -> None:
    ids = small_experiment("page-test findings", variant_status="succeeded", hit_rates=(0.1, 0.7))
    found = _comparison(web_db, ids["experiment_id"])["findings"]
    assert [f["code"] for f in found] == ["hit_rate_up_e2e_flat"]
    page.goto(f"{live_server}/experiments/{ids['experiment_id']}")
    items = page.locator("#findings li")
    expect(items).to_have_count(1)
    expect(items.first).to_have_attribute("data-code", "hit_rate_up_e2e_flat")
    expect(items.first.locator(".sev")).to_have_text("info")
    expect(items.first.locator(".message")).to_have_text(found[0]["message"])
    items.first.locator("summary").click()
    evidence = items.first.locator("table")
    expect(evidence).to_contain_text("median_e2el_ms_verdict")
    ci = found[0]["evidence"]["median_e2el_ms_ci"]
    expect(evidence).to_contain_text(f"[{ci[0]:.3f}, {ci[1]:.3f}]")
    expect(page.locator("#no-findings")).to_have_count(0)


def test_live_status_update_without_reload(
    page: Page,
    live_server: str,
    web_db: sessionmaker[Session],
    small_experiment: Callable[..., dict[str, str]],
) -> None:
    ids = small_experiment("page-test live", variant_status="running", hit_rates=(0.0, 0.4))
    page.goto(f"{live_server}/experiments/{ids['experiment_id']}")
    status = page.locator(f'li[data-run-id="{ids["apc-on"]}"] .status')
    expect(status).to_have_text("running")
    expect(page.locator("#exp-status")).to_have_text("running")
    expect(page.locator("#live")).to_be_visible()
    cell = page.locator('#ladder tr[data-variant="apc-on"] td[data-metric="median_ttft_ms"]')
    expect(cell.locator(".verdict")).to_have_text("insufficient data")
    notes = page.locator('#ladder tr[data-notes-for="apc-on"]')
    expect(notes).to_contain_text("insufficient data: 1 succeeded run(s) of 'baseline' and 0")
    page.evaluate("() => { window.__sameDocument = true; }")

    with web_db.begin() as s:
        s.execute(
            update(Run)
            .where(Run.id == ids["apc-on"])
            .values(status="succeeded", finished_at=datetime.now(UTC))
        )
    expect(status).to_have_text("succeeded", timeout=12_000)
    expect(page.locator("#exp-status")).to_have_text("succeeded")
    # the comparison was reloaded: TTFT 40 % lower with APC on -> better
    expect(cell.locator(".verdict")).to_have_text("better")
    expect(notes).to_contain_text("one repeat on a side")
    expect(page.locator("#live")).to_be_hidden()
    assert page.evaluate("() => window.__sameDocument === true")  # no page reload
    assert _chart(page)["points"][1]["y"] is not None


def test_unknown_experiment_is_a_404_page(page: Page, live_server: str) -> None:
    allow_console_error(page, "status of 404")
    response = page.goto(f"{live_server}/experiments/{uuid.uuid4()}")
    assert response is not None and response.status == 404
    expect(page.locator("p.error")).to_contain_text("No experiment")


@pytest.mark.timing
def test_page_renders_fast_on_real_data(live_server: str, seeded: dict[str, Any]) -> None:
    """The bootstrap (2000 draws) runs on the first view; later views hit the cache."""
    import web.pages.experiment as module

    url = f"{live_server}/experiments/{seeded['older']['experiment_id']}"
    module._cache.clear()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        r = httpx.get(url, timeout=30)
        times.append(time.perf_counter() - t0)
        assert r.status_code == 200 and 'data-variant="apc-on"' in r.text
    print(f"experiment page: first view {times[0]:.3f} s, cached {times[1]:.3f} s")
    assert times[0] < 3.0 and times[1] < 0.5
