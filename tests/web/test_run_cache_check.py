"""The run page's warm-cache flag: a run whose measured requests began on a warm prefix
cache shows a badge, the check's note and the advisor's warning; a clean run shows the
check without alarm.

The check is the real rule (:func:`jobs.signals.cachecheck.check`) on the shape the stub server
gives when ``POST /reset_prefix_cache`` answers 200 and keeps the blocks (vLLM's block
pool refusing the reset while blocks are held, vllm/v1/core/block_pool.py, behind an
API server that did not check the result): the first measured request reports 48
cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from jobs.schemas import RequestRecord
from jobs.signals.cachecheck import check
from orchestrator.core.models import Experiment, Run
from tests.web.seed import DATA, load_export


def _records(first_cached: int) -> list[RequestRecord]:
    """Concurrency 1: each request sent when the previous one finished."""
    return [
        RequestRecord(
            index=i,
            success=True,
            start_s=2.0 + 0.2 * i,
            ttft_s=0.05,
            e2el_s=0.15,
            prompt_tokens=120,
            cached_tokens=first_cached if i == 0 else 48,
        )
        for i in range(4)
    ]


@pytest.fixture(scope="module")
def flagged(web_db: sessionmaker[Session]) -> Iterator[dict[str, Any]]:
    """A copy of the demo experiment: apc-on#0 measured on a warm cache, apc-on#1 clean."""
    with web_db.begin() as s:
        ids = load_export(s, DATA / "demo_experiment.json", name=f"warm-{uuid.uuid4().hex[:6]}")
        for key, first in (("apc-on#0", 48), ("apc-on#1", 0)):
            run = s.get(Run, ids["runs"][key])
            assert run is not None
            result = check(_records(first), None, [], reports_cached_tokens=True, reset_ok=True)
            run.engine_info = {**run.engine_info, "cache_contamination": result}
    yield ids
    with web_db.begin() as s:
        s.execute(delete(Run).where(Run.experiment_id == ids["experiment_id"]))
        s.execute(delete(Experiment).where(Experiment.id == ids["experiment_id"]))


def test_warm_cache_is_flagged_on_the_run_page(
    page: Page, live_server: str, flagged: dict[str, Any]
) -> None:
    page.goto(f"{live_server}/runs/{flagged['runs']['apc-on#0']}")
    expect(page.locator("#warm-cache")).to_have_text("warm cache")
    line = page.locator("#cache-check")
    expect(line).to_have_attribute("data-status", "contaminated")
    expect(line).to_contain_text("the first measured request found 48 or more prompt tokens")
    expect(line).to_contain_text("restart the vLLM server for each run")
    finding = page.locator('#findings-list li[data-code="warm_cache"]')
    expect(finding).to_have_count(1)
    expect(finding).to_contain_text("VLLM_SERVER_DEV_MODE=1")
    # the same flag in the run's JSON
    doc = page.request.get(f"{live_server}/api/v1/runs/{flagged['runs']['apc-on#0']}").json()
    assert doc["engine_info"]["cache_contamination"]["status"] == "contaminated"
    # and in the experiment's comparison: no metric of apc-on vs baseline has a verdict
    cmp = page.request.get(
        f"{live_server}/api/v1/experiments/{flagged['experiment_id']}/comparison"
    ).json()
    (apc,) = [v for v in cmp["variants"] if v["variant"] == "apc-on"]
    assert apc["metrics"] and not any(m["trustworthy"] for m in apc["metrics"])
    assert all(
        m["verdict"] in ("untrusted", "not applicable") and m["ratio"] is None
        for m in apc["metrics"]
    )
    warm = f"variant run {flagged['runs']['apc-on#0']}: measured on a warm prefix cache"
    assert warm in apc["metrics"][0]["untrusted_reason"]
    assert cmp["findings"][0]["code"] == "warm_cache_contamination"
    # the ladder shows the values greyed with the reason, no verdict
    page.goto(f"{live_server}/experiments/{flagged['experiment_id']}")
    cell = page.locator('#ladder tr[data-variant="apc-on"] td[data-metric="median_ttft_ms"]')
    expect(cell).to_have_attribute("data-verdict", "untrusted")
    expect(cell.locator(".verdict")).to_have_text("untrusted: no verdict")
    expect(cell).to_contain_text("measured on a warm prefix cache")
    expect(cell.locator(".ratio")).to_have_count(0)


def test_clean_run_shows_the_check_without_a_badge(
    page: Page, live_server: str, flagged: dict[str, Any]
) -> None:
    page.goto(f"{live_server}/runs/{flagged['runs']['apc-on#1']}")
    expect(page.locator("#warm-cache")).to_have_count(0)
    expect(page.locator("#cache-check")).to_have_attribute("data-status", "clean")
    expect(page.locator('#findings-list li[data-code="warm_cache"]')).to_have_count(0)
