"""The experiment page's tables and the capacity tables fit a 1400 px window (issue
#26): the ladder (with its capacity column), the Pareto table and the run page's
load-steps table show every cell inside the window and inside their scroll box,
none hidden past a right edge (headed screenshots at 1400 px showed them cut)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Page
from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.models import Experiment, Run
from tests.web.seed import capacity_runs

# Every visible cell of every table: where its right edge lies past the window, past
# an ancestor that clips or scrolls (a scroll box hides what needs scrolling), or where
# its own content overflows it. Each problem as [kind, table id, cell text, px over].
HIDDEN_CELLS = """() => {
  const problems = [];
  const vw = document.documentElement.clientWidth;
  for (const cell of document.querySelectorAll('table td, table th')) {
    if (!cell.offsetParent) continue;
    const table = cell.closest('table');
    const text = cell.textContent.trim().slice(0, 40);
    const right = cell.getBoundingClientRect().right;
    if (right > vw + 0.5) problems.push(['past the window', table.id, text, right - vw]);
    for (let p = table.parentElement; p && p !== document.body; p = p.parentElement) {
      if (getComputedStyle(p).overflowX === 'visible') continue;
      const edge = p.getBoundingClientRect().left + p.clientLeft + p.clientWidth;
      if (right > edge + 0.5) problems.push(['past its box', table.id, text, right - edge]);
    }
    if (cell.scrollWidth > cell.clientWidth + 1)
      problems.push(['overflows the cell', table.id, text, cell.scrollWidth - cell.clientWidth]);
  }
  return problems;
}"""


@pytest.fixture(scope="module")
def cap_data(web_db: sessionmaker[Session]) -> Iterator[dict[str, Any]]:
    with web_db.begin() as s:
        data = capacity_runs(s, name=f"capacity-fit-{uuid.uuid4().hex[:8]}")
    yield data
    with web_db.begin() as s:
        s.execute(delete(Run).where(Run.experiment_id == data["experiment_id"]))
        s.execute(delete(Experiment).where(Experiment.id == data["experiment_id"]))


def _assert_tables_fit(page: Page, tables: list[str]) -> None:
    assert page.viewport_size == {"width": 1400, "height": 900}
    for table in tables:  # the tables the issue names are there, with rows
        assert page.locator(f"{table} tbody tr").count() > 0, table
    overflow = page.evaluate(
        "() => [document.documentElement.scrollWidth, document.documentElement.clientWidth]"
    )
    assert overflow[0] <= overflow[1], f"the page scrolls sideways: {overflow}"
    assert page.evaluate(HIDDEN_CELLS) == []


def test_capacity_experiment_tables_fit_1400px(
    page: Page, live_server: str, cap_data: dict[str, Any]
) -> None:
    page.goto(f"{live_server}/experiments/{cap_data['experiment_id']}")
    page.locator("#ladder td.capacity").first.wait_for()
    _assert_tables_fit(page, ["#ladder", "#pareto-table"])


def test_real_experiment_tables_fit_1400px(
    page: Page, live_server: str, seeded: dict[str, Any]
) -> None:
    page.goto(f"{live_server}/experiments/{seeded['real']['experiment_id']}")
    _assert_tables_fit(page, ["#ladder"])


def test_capacity_steps_table_fits_1400px(
    page: Page, live_server: str, cap_data: dict[str, Any]
) -> None:
    page.goto(f"{live_server}/runs/{cap_data['runs']['baseline']}")
    steps = page.locator("#capacity-steps tbody tr")
    assert steps.count() == len(cap_data["documents"]["baseline"]["steps"])
    # the saturation note of the overloaded step is shown (wrapped in its column)
    assert page.locator("#capacity-steps [data-col=saturated]").count() > 0
    _assert_tables_fit(page, ["#capacity-steps"])
