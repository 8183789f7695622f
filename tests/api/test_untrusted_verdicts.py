"""No verdict from an untrustworthy number, end to end: runs measured by the real client
against the stub (apc-on streaming in bursts: TPOT p50 0.0 ms; the baseline paced, with
prefix caching off: no hit rate), stored, then read through
``GET /api/v1/experiments/{id}/comparison``, the experiment page's ladder cells and the
CLI's tables (issue #22: "ratio 0.00 [0.00, 0.78] better" and "better [0.90, 0.90]")."""

from __future__ import annotations

import json
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
    # the metric chart: apc-on's TPOT point is grey (no verdict) and has no interval
    start = page.text.index('<script type="application/json" id="chart-data">')
    chart = json.loads(
        page.text[page.text.index(">", start) + 1 : page.text.index("</script>", start)]
    )
    (tpot_chart,) = [m for m in chart["metrics"] if m["name"] == "median_tpot_ms"]
    _, apc_point = tpot_chart["points"]
    assert apc_point["verdict"] == "untrusted" and apc_point["ci_low"] is None
    assert "token bursts" in apc_point["untrusted_reason"]
    # the compare page (any runs side by side): the same cell without a verdict
    run_ids = [r["id"] for r in body["runs"] if r["repeat_index"] == 0]
    compare = client.get(f"/compare?run={run_ids[0]}&run={run_ids[1]}").text
    assert "untrusted: no verdict" in compare and "token bursts" in compare

    # the CLI: the comparison table and the per-run table
    def render(table: Any, width: int = 400) -> str:
        console = Console(record=True, width=width, color_system=None)
        console.print(table)
        return console.export_text()

    text = render(comparison_table(comp))
    tpot_line = next(ln for ln in text.splitlines() if "median_tpot_ms" in ln)
    assert "untrusted (note 1)" in tpot_line and "better" not in tpot_line
    # the reason, with the runs' ids, below the table: at 100 columns no id is split
    note = next(ln for ln in text.splitlines() if ln.startswith("note 1: "))
    assert note.startswith("note 1: untrusted: variant run ") and "token bursts" in note
    narrow = render(comparison_table(comp), 100)
    flagged_ids = [r["id"] for r in body["runs"] if r["id"] in text]
    assert flagged_ids and all(i in narrow for i in flagged_ids), narrow
    assert max(len(ln) for ln in narrow.splitlines()) <= 100, narrow
    hit_line = next(ln for ln in text.splitlines() if "prefix_cache_hit_rate" in ln)
    assert "n/a (off)" in hit_line and "not applicable" in hit_line
    assert "better" not in hit_line and "0.90, 0.90" not in hit_line
    text = render(result_table(client.get(f"/api/v1/experiments/{body['id']}").json()))
    run_lines = [ln for ln in text.splitlines() if ln.lstrip("│ ").startswith("apc-on")]
    assert len(run_lines) == 2 and all("(flagged)" in ln for ln in run_lines)
    base_lines = [ln for ln in text.splitlines() if ln.lstrip("│ ").startswith("baseline")]
    assert len(base_lines) == 2 and all("n/a (off)" in ln for ln in base_lines)
    assert "flagged (no verdict from these values)" in " ".join(text.split())
    # fixed narrow figure columns: marked `*`, never a split `(flagg` / `ed)`
    exp_doc = client.get(f"/api/v1/experiments/{body['id']}").json()
    narrow = render(result_table(exp_doc, 100), 100)
    assert "flagg" not in narrow.split("flagged (no verdict")[0], narrow
    assert "* flagged (no verdict from these values)" in " ".join(narrow.split()), narrow


def _client_limited_doc() -> dict[str, Any]:
    """A search (with the fields of issue #22's capacity search) that passed 40 req/s and
    reached the load generator's ceiling at 60: at least 40, ceiling 45 req/s."""
    doc = capacity_documents()["apc-on"]
    passed, limited, saturated = (dict(s) for s in doc["steps"][:3])
    passed.update(index=0, load=40.0, verdict="pass", saturated=None)
    limited.update(
        index=1,
        load=60.0,
        verdict="client_limited",
        saturated=None,
        signals={**limited["signals"], "asked_rate": 60.0, "arrived_rate": 44.0,
                 "client_cpu": 0.97, "client_workers": 1},
    )  # fmt: skip
    saturated.update(
        index=2,
        load=50.0,
        verdict="fail",
        saturated="waiting requests grew",
        saturation_evidence=["waiting queue grew 0 -> 35", "KV cache 96 % full"],
    )
    return {
        **doc,
        "status": "client_limited",
        "capacity": None,
        "interval": [40.0, None],
        "client_ceiling": 45.0,
        "binding_slo": "saturated",
        "steps": [passed, limited, saturated],
    }


def test_client_limited_search_on_the_run_and_experiment_pages(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    body = client.post("/api/v1/experiments", json=demo_spec(repeats=1)).json()
    ids = {r["name"]: r["id"] for r in body["runs"]}
    _finish(session_factory, ids["baseline"], "paced", capacity=_capacity_doc("baseline"))
    _finish(session_factory, ids["apc-on"], "paced", capacity=_client_limited_doc())

    page = client.get(f"/runs/{ids['apc-on']}").text
    assert 'id="capacity-value">at least 40.0 req/s<' in page
    assert "the load generator&#39;s ceiling here is 45.0 req/s" in page
    assert "Scale the load generator out" in page
    # saturation is said with the server's evidence, shown
    assert (
        "the server saturated before any objective failed (waiting queue grew 0 -&gt; 35; "
        "KV cache 96 % full)" in page
    )
    assert "server saturated: waiting queue grew 0 -&gt; 35; KV cache 96 % full" in page
    # the client-limited step: no verdict, why, and the load that arrived
    assert "could not deliver this load (44 of the 60 req/s asked arrived)" in page
    assert "44.00 / 60.00" in page

    comp = client.get(f"/api/v1/experiments/{body['id']}/comparison").json()
    cap = comp["variants"][0]["capacity"]
    assert cap["verdict"] == "higher" and cap["ci_high"] is None
    assert cap["statement"] == "higher: at least 18.2x"  # 40 / 2.2
    assert cap["client_ceiling"] == {"reference": None, "variant": 45.0}
    parser = _Cells()
    parser.feed(client.get(f"/experiments/{body['id']}").text)
    attrs, text = parser.cells[("apc-on", "capacity")]
    assert attrs["data-verdict"] == "higher"
    assert text.startswith("at least 40 vs 2.10") and f"≥ {40.0 / 2.2:.1f}×" in text


def test_a_flagged_reference_level_shows_its_value_greyed_without_an_interval(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    body = client.post("/api/v1/experiments", json=demo_spec(repeats=2)).json()
    for r in body["runs"]:
        _finish(session_factory, r["id"], "burst" if r["name"] == "baseline" else "paced")
    parser = _Cells()
    parser.feed(client.get(f"/experiments/{body['id']}").text)
    attrs, text = parser.cells[("baseline", "median_tpot_ms")]
    assert attrs["data-flagged"] == "true" and "untrusted: run " in text
    assert "[" not in text  # its own bootstrap interval is not shown
    attrs, text = parser.cells[("baseline", "median_ttft_ms")]
    assert "data-flagged" not in attrs and "[" in text  # TTFT is not flagged: its interval
    # and the variant's TPOT against a flagged reference: no verdict either
    attrs, text = parser.cells[("apc-on", "median_tpot_ms")]
    assert attrs["data-verdict"] == "untrusted" and "reference run" in text
