"""No verdict from an untrustworthy number, end to end: runs measured by the real client
against the stub (apc-on streaming in bursts: TPOT p50 0.0 ms; the baseline paced, with
prefix caching off: no hit rate), stored, then read through
``GET /api/v1/experiments/{id}/comparison``, the experiment page's ladder cells and the
CLI's tables (issue #22: "ratio 0.00 [0.00, 0.78] better" and "better [0.90, 0.90]")."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

from fastapi.testclient import TestClient
from rich.console import Console
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.cli.report import comparison_table, result_table
from orchestrator.core.models import Experiment, Run
from orchestrator.core.repositories import RunRepository
from tests.api.test_api import demo_spec
from tests.orchestrator.analysis.stub_bursts import stub_run
from tests.web.seed import capacity_documents

TPOT_ITL = ("median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")


def _finish(
    session_factory: sessionmaker[Session],
    run_id: str,
    kind: str,
    extra: dict[str, float] | None = None,
    capacity: dict[str, Any] | None = None,
) -> None:
    requests, metrics = stub_run(kind)
    with session_factory() as s:
        run = s.get(Run, run_id)
        assert run is not None
        RunRepository(s).save_measurements(
            run_id,
            metrics={**metrics, **(extra or {})},
            samples=[],
            requests=requests,
            engine_log="",
        )
        run.status = "succeeded"
        run.capacity = capacity
        s.commit()


def _capacity_doc(variant: str) -> dict[str, Any]:
    """A found search whose steps checked a TPOT objective (the dashboard's seed documents:
    baseline 2.1 req/s, apc-on 4.2 req/s)."""
    return capacity_documents()[variant]


def _experiment(client: TestClient, session_factory: sessionmaker[Session]) -> dict[str, Any]:
    body = client.post("/api/v1/experiments", json=demo_spec(repeats=2)).json()
    with session_factory() as s:
        exp = s.get(Experiment, body["id"])
        assert exp is not None
        exp.spec = {**exp.spec, "capacity": {"slos": {"tpot_ms": {"p99": 50}}, "min": 1, "max": 16}}
        s.commit()
    for r in body["runs"]:
        if r["name"] == "baseline":  # prefix caching off: no hit rate stored
            _finish(session_factory, r["id"], "paced", capacity=_capacity_doc("baseline"))
        else:
            hit = {"prefix_cache_hit_rate": 0.9}
            _finish(session_factory, r["id"], "burst", hit, capacity=_capacity_doc("apc-on"))
    return body


class _Cells(HTMLParser):
    """The ladder's metric cells: ``{(variant, metric): (attributes, text)}``."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[tuple[str, str], tuple[dict[str, str | None], str]] = {}
        self._variant: str | None = None
        self._cell: tuple[str, dict[str, str | None]] | None = None
        self._text: list[str] = []
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tr" and a.get("data-variant"):
            self._variant = a["data-variant"]
        if self._cell is not None and tag == "td":
            self._depth += 1
        if tag == "td" and self._variant and a.get("data-metric") and self._cell is None:
            self._cell, self._text, self._depth = (str(a["data-metric"]), a), [], 0

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            if self._depth:
                self._depth -= 1
                return
            metric, attrs = self._cell
            text = " ".join(" ".join(self._text).split())
            self.cells[(str(self._variant), metric)] = (attrs, text)
            self._cell = None
        if tag == "tr":
            self._variant = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._text.append(data)


def test_comparison_ladder_and_cli_give_no_verdict_from_flagged_numbers(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    body = _experiment(client, session_factory)
    comp = client.get(f"/api/v1/experiments/{body['id']}/comparison").json()
    (variant,) = comp["variants"]
    rows = {m["metric"]: m for m in variant["metrics"]}

    # the comparison: TPOT and ITL flagged, no ratio, no interval, no verdict
    tpot = rows["median_tpot_ms"]
    assert tpot["variant"] < 0.1 * tpot["reference"]  # the burst TPOT, ~0 ms
    for metric in TPOT_ITL:
        row = rows[metric]
        assert row["verdict"] == "untrusted" and row["trustworthy"] is False, metric
        assert row["ratio"] is None and row["ci_low"] is None and row["ci_high"] is None
        assert "token bursts" in row["untrusted_reason"]
    assert rows["median_ttft_ms"]["verdict"] != "untrusted"
    # the hit rate with prefix caching off: n/a, never 0, never an interval
    hit = rows["prefix_cache_hit_rate"]
    assert hit["verdict"] == "not applicable" and hit["not_applicable"] == {"reference": "off"}
    assert hit["reference"] is None and hit["ci_low"] is None and hit["ci_high"] is None
    # capacity checked a TPOT objective on a bursty run: no capacity verdict either
    cap = variant["capacity"]
    assert cap["verdict"] == "untrusted" and cap["ci_low"] is None and cap["ratio"] is None
    assert "token bursts" in cap["untrusted_reason"]

    # the experiment page's ladder cells
    page = client.get(f"/experiments/{body['id']}")
    assert page.status_code == 200, page.text
    parser = _Cells()
    parser.feed(page.text)
    for metric in ("median_tpot_ms",):
        attrs, text = parser.cells[("apc-on", metric)]
        assert attrs["data-verdict"] == "untrusted"
        assert "untrusted: no verdict" in text and "token bursts" in text
        assert "better" not in text and "×" not in text and "[" not in text
    attrs, text = parser.cells[("apc-on", "prefix_cache_hit_rate")]
    assert attrs["data-verdict"] == "not applicable"
    assert "90.0" in text and "vs n/a (off)" in text and "better" not in text
    attrs, text = parser.cells[("baseline", "prefix_cache_hit_rate")]
    assert text.startswith("n/a (off)")
    attrs, text = parser.cells[("apc-on", "capacity")]
    assert attrs["data-verdict"] == "untrusted" and "higher" not in text
    # the Pareto chart has no point from 1000 / a burst TPOT
    assert 'id="pareto-untrusted"' in page.text

    # the CLI: the comparison table and the per-run table
    def render(table: Any) -> str:
        console = Console(record=True, width=400, color_system=None)
        console.print(table)
        return console.export_text()

    text = render(comparison_table(comp))
    tpot_line = next(ln for ln in text.splitlines() if "median_tpot_ms" in ln)
    assert "untrusted: variant run" in tpot_line and "better" not in tpot_line
    hit_line = next(ln for ln in text.splitlines() if "prefix_cache_hit_rate" in ln)
    assert "n/a (off)" in hit_line and "not applicable" in hit_line
    assert "better" not in hit_line and "0.90, 0.90" not in hit_line
    text = render(result_table(client.get(f"/api/v1/experiments/{body['id']}").json()))
    run_lines = [ln for ln in text.splitlines() if ln.lstrip("│ ").startswith("apc-on")]
    assert len(run_lines) == 2 and all("(flagged)" in ln for ln in run_lines)
    base_lines = [ln for ln in text.splitlines() if ln.lstrip("│ ").startswith("baseline")]
    assert len(base_lines) == 2 and all("n/a (off)" in ln for ln in base_lines)
    assert "flagged (no verdict from these values)" in " ".join(text.split())
