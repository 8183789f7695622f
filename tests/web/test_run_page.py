"""The run page in a real Chromium: header, cards, charts, distributions, tables,
the engine log filter, the parity report, live updates and the 404 page."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from playwright.sync_api import Page, expect
from sqlalchemy import func, insert, inspect, select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.cluster.parity import check_parity
from orchestrator.core.models import Experiment, Run, RunLog, RunMetric, RunRequest, RunSample
from orchestrator.core.repositories import RunRepository
from tests.web.conftest import allow_console_error, screenshot

CHARTS = ("chart-kv", "chart-queue", "chart-throughput", "chart-hit", "chart-ttft", "chart-e2el")


def _experiment(session: Session, label: str) -> str:
    """A fresh experiment for this module's own runs (unique name, own model id)."""
    exp = Experiment(
        id=str(uuid.uuid4()),
        name=f"runpage-{label}-{uuid.uuid4().hex[:8]}",
        spec={},
        model_id="runpage-model",
        model_digest="0" * 64,
        request_list_hash="1" * 64,
    )
    session.add(exp)
    session.flush()
    return exp.id


def _clone_run(session: Session, source_id: str, experiment_id: str, **changes: Any) -> Run:
    """A copy of run ``source_id`` (configuration only: no metrics, samples or log)."""
    src = session.get(Run, source_id)
    assert src is not None
    cols = {c.key: getattr(src, c.key) for c in inspect(Run).column_attrs}
    cols.update(id=str(uuid.uuid4()), experiment_id=experiment_id, reference_run_id=None)
    cols.update(model_id="runpage-model", claimed_by=None)
    cols.update(changes)
    run = Run(**cols)
    session.add(run)
    session.flush()
    return run


def _chart_points(page: Page, canvas_id: str) -> int:
    return int(
        page.evaluate(
            "id => Chart.getChart(document.getElementById(id))"
            ".data.datasets.reduce((n, d) => n + d.data.filter(p => p.y !== null).length, 0)",
            canvas_id,
        )
    )


def _wait_chart(page: Page, canvas_id: str, at_least: int = 1) -> None:
    page.wait_for_function(
        "([id, n]) => { const c = Chart.getChart(document.getElementById(id));"
        " return c && c.data.datasets.length > 0 && c.data.datasets[0].data.length >= n; }",
        arg=[canvas_id, at_least],
    )


def test_real_run_shows_header_cards_charts_and_tables(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    runs = seeded["real"]["runs"]
    run_id = runs["apc-on#0"]
    with web_db() as s:
        metrics = RunRepository(s).metrics(run_id)
        measured_ok = s.scalar(
            select(func.count())
            .select_from(RunRequest)
            .where(RunRequest.run_id == run_id, RunRequest.warmup.is_(False))
            .where(RunRequest.success.is_(True))
        )
    page.goto(f"{live_server}/runs/{run_id}")

    # header: name, experiment, status, the change vs the reference run
    expect(page.locator("#run-name")).to_have_text("apc-on #1")  # repeats count from 1
    expect(page.locator("#experiment-link")).to_have_text("demo apc")
    expect(page.locator("#experiment-link")).to_have_attribute(
        "href", f"/experiments/{seeded['real']['experiment_id']}"
    )
    expect(page.locator("#status")).to_have_text("succeeded")
    expect(page.locator("#live")).to_be_hidden()
    expect(page.locator("#changes")).to_contain_text("engine_args.enable_prefix_caching = true")
    expect(page.locator("#reference-link")).to_have_attribute("href", f"/runs/{runs['baseline#0']}")
    expect(page.locator("#duration")).to_have_text("5.1 s")  # 18:39:43.10 -> 18:39:48.25

    # cards: the stored metrics, formatted
    card = page.locator('#cards .card[data-metric="median_ttft_ms"] .v')
    expect(card).to_have_text(f"{metrics['median_ttft_ms']:,.1f}")
    hit = page.locator('#cards .card[data-metric="prefix_cache_hit_rate"] .v')
    expect(hit).to_have_text(f"{metrics['prefix_cache_hit_rate'] * 100:.1f} %")
    expect(page.locator('#cards .card[data-metric="output_throughput"] .v')).to_have_text(
        f"{metrics['output_throughput']:,.1f}"
    )
    # no goodput SLOs in the demo: no goodput card
    expect(page.locator('#cards .card[data-metric="request_goodput"]')).to_have_count(0)

    # every chart has data: 6 samples (before, 4 during, after) -> 6 gauge points, 5 deltas
    for canvas in CHARTS:
        _wait_chart(page, canvas)
    assert _chart_points(page, "chart-kv") == 6
    assert (
        page.evaluate("Chart.getChart(document.getElementById('chart-queue')).data.datasets.length")
        == 2
    )
    assert _chart_points(page, "chart-throughput") == 2 * 5
    band = page.evaluate(
        "Chart.getChart(document.getElementById('chart-kv')).options.plugins.phaseBand"
    )
    assert band["from"] == 45.895097978000024 and band["to"] == 49.86953468899998
    # histograms: every successful measured request counted once; p50 from the metrics
    counted = page.evaluate(
        "Chart.getChart(document.getElementById('chart-ttft')).data.datasets"
        ".reduce((n, d) => n + d.data.reduce((m, p) => m + p.y, 0), 0)"
    )
    assert counted == measured_ok == 16
    expect(page.locator("#ttft-pct")).to_have_text(
        f"p50 {metrics['p50_ttft_ms']:,.1f} · p99 {metrics['p99_ttft_ms']:,.1f}"
    )
    for canvas in CHARTS:
        expect(page.locator(f'.chart-empty[data-for="{canvas}"]')).to_be_hidden()

    # metrics table: grouped, every metric once
    expect(page.locator("#metrics-client tr[data-metric=median_ttft_ms] td.num")).to_have_text(
        f"{metrics['median_ttft_ms']:,.1f}"
    )
    expect(page.locator("#metrics-server tr[data-metric=server_mean_ttft_ms]")).to_have_count(1)
    expect(
        page.locator("#metrics-server tr[data-metric=prefix_cache_hit_rate] td.num")
    ).to_have_text(f"{metrics['prefix_cache_hit_rate'] * 100:.1f}")
    assert page.locator("table.metrics tbody tr").count() == len(metrics)
    expect(page.locator("#class-empty")).to_contain_text("One request class")

    # configuration: the explicit engine args, the changed one marked
    apc = page.locator('#explicit-args tr[data-arg="enable_prefix_caching"]')
    expect(apc).to_contain_text("true")
    expect(apc.locator(".badge.changed")).to_have_count(1)
    expect(page.locator("#model-table")).to_contain_text("0.32.0")
    expect(page.locator("#startup-table")).to_contain_text("kv_cache_size_tokens")
    expect(page.locator("#startup-table")).to_contain_text("131072")

    # node layout and parity: one node, CPU binding 0-1, no parity check
    rows = page.locator("#placement-table tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("192.0.2.2")
    expect(rows.first.locator("td").nth(7)).to_have_text("0-1")
    expect(page.locator("#parity-empty")).to_have_text("Single-node run: no parity check.")
    expect(page.locator("#log")).to_contain_text("non-default args")
    screenshot(page, "run")


def test_engine_log_filter(page: Page, live_server: str, seeded: dict[str, Any]) -> None:
    run_id = seeded["real"]["runs"]["baseline#0"]
    response = page.request.get(f"{live_server}/api/v1/runs/{run_id}/log")
    lines = response.text().splitlines()
    dropped = int(response.headers["x-noise-lines-dropped"])
    assert dropped > 0  # the real log has /health and /metrics probe lines
    warn = [line for line in lines if re.search(r"\b(WARNING|WARN|ERROR|CRITICAL)\b", line)]
    assert warn

    page.goto(f"{live_server}/runs/{run_id}")
    log = page.locator("#log")
    expect(log).to_contain_text("non-default args")
    expect(page.locator("#log-count")).to_have_text(
        f"{len(lines)} of {len(lines)} lines · {dropped} probe lines (/health, /metrics) dropped"
    )
    assert "GET /metrics HTTP" not in log.inner_text()

    page.select_option("#log-level", "warn")
    expect(page.locator("#log-count")).to_contain_text(f"{len(warn)} of {len(lines)} lines")
    shown = log.inner_text().splitlines()
    assert shown == warn

    page.select_option("#log-level", "")
    page.fill("#log-filter", "ulimit")
    expected = [line for line in lines if "ulimit" in line.lower()]
    expect(page.locator("#log-count")).to_contain_text(f"{len(expected)} of {len(lines)} lines")
    assert log.inner_text().splitlines() == expected and expected

    page.fill("#log-filter", "no such text in the log")
    expect(log).to_have_text("(no line matches the filter)")
    expect(page.locator("#log-raw")).to_have_attribute("href", f"/api/v1/runs/{run_id}/log?raw=1")


def test_per_class_table(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    src = seeded["real"]["runs"]["baseline#1"]
    with web_db.begin() as s:
        base = RunRepository(s).metrics(src)
        run = _clone_run(s, src, _experiment(s, "classes"), name="mixed")
        rows = [{"run_id": run.id, "name": k, "value": v} for k, v in base.items()]
        for cls, scale in (("short", 1.0), ("long", 3.0)):
            rows += [
                {"run_id": run.id, "name": f"{cls}.{k}", "value": v * scale}
                for k, v in base.items()
                if k.endswith("_ms") or k in ("completed", "failed", "output_throughput")
            ]
        s.execute(insert(RunMetric), rows)
        run_id = run.id
    page.goto(f"{live_server}/runs/{run_id}")
    table = page.locator("#class-table")
    expect(table.locator("tbody tr")).to_have_count(2)
    assert table.locator("tbody tr").evaluate_all("rs => rs.map(r => r.dataset.class)") == [
        "long",
        "short",
    ]
    long_ttft = table.locator('tr[data-class="long"] td[data-col="median_ttft_ms"]')
    expect(long_ttft).to_have_text(f"{base['median_ttft_ms'] * 3:,.1f}")
    expect(table.locator('tr[data-class="short"] td[data-col="p99_e2el_ms"]')).to_have_text(
        f"{base['p99_e2el_ms']:,.1f}"
    )
    expect(table.locator('tr[data-class="long"] td[data-col="completed"]')).to_have_text(
        f"{int(base['completed'] * 3)}"
    )
    expect(table.locator('tr[data-class="long"] td[data-col="request_goodput"]')).to_have_text("–")
    expect(page.locator("#metrics-class tr[data-metric='long.median_ttft_ms']")).to_have_count(1)
    # no samples, requests or log for this copy: clear empty states, no errors
    expect(page.locator('.chart-empty[data-for="chart-kv"]')).to_have_text("no samples yet")
    expect(page.locator('.chart-empty[data-for="chart-ttft"]')).to_be_visible()
    expect(page.locator("#log-empty")).to_have_text("No engine log yet.")


def test_parity_report_from_check_parity(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    fingerprint = {
        "python": "3.12.3",
        "ray": "2.49.1",
        "vllm": "0.32.0",
        "torch": "2.9.0+cpu",
        "env": {"NCCL_DEBUG": "WARN"},
    }
    nodes = [
        {**fingerprint, "node": "rank0:head", "ip": "10.0.0.1"},
        {
            **fingerprint,
            "node": "rank1:worker",
            "ip": "10.0.0.2",
            "vllm": "0.31.1",
            "env": {"NCCL_DEBUG": "INFO"},
        },
    ]
    report = check_parity(nodes, {"tensor_parallel_size": 1, "pipeline_parallel_size": 2})
    assert report["verdict"] == "blocked" and [m["field"] for m in report["mismatches"]] == ["vllm"]
    placement = {
        "nodes": [
            {"rank": r, "node_id": f"{r}" * 40, "ip": f"10.0.0.{r + 1}", "devices": 1,
             "reserved": 1, "bundles": [r], "stages": [r]}
            for r in range(2)
        ],
        "nnodes": 2, "exclusive": False, "policy": "shared_nodes", "resource": "GPU",
        "tensor_parallel_size": 1, "pipeline_parallel_size": 2,
    }  # fmt: skip
    with web_db.begin() as s:
        run = _clone_run(
            s,
            seeded["real"]["runs"]["baseline#0"],
            _experiment(s, "parity"),
            status="blocked",
            status_reason="node parity check failed: vllm differs on rank1:worker",
            parity=report,
            placement=placement,
        )
        run_id = run.id
    page.goto(f"{live_server}/runs/{run_id}")
    expect(page.locator("#status")).to_have_text("blocked")
    expect(page.locator("#status-reason")).to_contain_text("node parity check failed")
    expect(page.locator("#parity-verdict")).to_contain_text("blocked")
    expect(page.locator("#parity-verdict")).to_contain_text("1 blocking mismatch")
    heads = page.locator("#parity-table thead th").all_inner_texts()
    assert heads[2:4] == ["rank0:head", "rank1:worker"]
    row = page.locator('#parity-table tr[data-field="vllm"]')
    expect(row.locator('td[data-node="rank0:head"]')).to_have_text("0.32.0")
    expect(row.locator('td[data-node="rank1:worker"]')).to_have_text("0.31.1")
    expect(row.locator("td.mismatch")).to_have_count(1)
    expect(row.locator("td.mismatch")).to_have_attribute("data-node", "rank1:worker")
    expect(row.locator(".badge")).to_have_text("blocking")
    expect(row).to_contain_text("vLLM version must be identical on all nodes")
    # the warning-only finding comes after the blocking one
    expect(page.locator("#parity-verdict")).to_contain_text("1 warning")
    assert page.locator("#parity-table tbody tr").evaluate_all(
        "rs => rs.map(r => r.dataset.field)"
    ) == ["vllm", "env.NCCL_DEBUG"]
    debug = page.locator('#parity-table tr[data-field="env.NCCL_DEBUG"]')
    expect(debug.locator(".badge")).to_have_text("warning")
    expect(debug.locator('td[data-node="rank1:worker"]')).to_have_text("INFO")
    expect(page.locator("#placement-table tbody tr")).to_have_count(2)
    # a rule that could not be decided is listed, never counted as ok
    expect(page.locator("#parity-reasons")).to_contain_text("vllm blocks on rank1:worker")
    expect(page.locator("#parity-unknown")).to_contain_text("comm_launch_shell_only")
    expect(page.locator("#parity-unknown")).to_contain_text("launching environment")
    screenshot(page, "run-parity")


def test_live_update_without_reload(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    src = seeded["real"]["runs"]["apc-on#1"]
    with web_db() as s:
        samples = [(p.t_s, p.phase, p.values) for p in RunRepository(s).samples(src)]
    assert [p[1] for p in samples] == ["before", "during", "during", "during", "after"]
    started = datetime.now(UTC) - timedelta(seconds=30)
    with web_db.begin() as s:
        run = _clone_run(
            s,
            src,
            _experiment(s, "live"),
            status="running",
            started_at=started,
            finished_at=None,
            progress={"phase": "measuring", "requests_done": 3, "requests_total": 16},
        )
        run_id = run.id
        s.execute(
            insert(RunSample),
            [{"run_id": run_id, "t_s": t, "phase": ph, "values": v} for t, ph, v in samples[:3]],
        )
    page.goto(f"{live_server}/runs/{run_id}")
    expect(page.locator("#status")).to_have_text("running")
    expect(page.locator("#live")).to_be_visible()
    expect(page.locator("#progress-text")).to_have_text("measuring · 3 / 16 requests")
    expect(page.locator('#cards .card[data-metric="median_ttft_ms"] .v')).to_have_text("–")
    expect(page.locator("#log-empty")).to_contain_text("stored when the run ends")
    _wait_chart(page, "chart-kv", 3)
    page.evaluate("window.__sameDocument = true")  # gone if the page reloads

    with web_db.begin() as s:
        s.get(Run, run_id).progress = {  # type: ignore[union-attr]
            "phase": "measuring",
            "requests_done": 12,
            "requests_total": 16,
        }
    expect(page.locator("#progress-text")).to_have_text("measuring · 12 / 16 requests")

    with web_db.begin() as s:
        s.execute(
            insert(RunSample),
            [{"run_id": run_id, "t_s": t, "phase": ph, "values": v} for t, ph, v in samples[3:]],
        )
        s.execute(
            insert(RunMetric),
            [
                {"run_id": run_id, "name": "median_ttft_ms", "value": 123.456},
                {"run_id": run_id, "name": "prefix_cache_hit_rate", "value": 0.75},
            ],
        )
        s.add(RunLog(run_id=run_id, content="INFO engine up\nERROR something to see\n"))
        r = s.get(Run, run_id)
        assert r is not None
        r.status = "succeeded"
        r.finished_at = started + timedelta(seconds=25)
        r.progress = {"phase": "done", "requests_done": 16, "requests_total": 16}
    expect(page.locator("#status")).to_have_text("succeeded", timeout=10_000)
    expect(page.locator("#live")).to_be_hidden()
    expect(page.locator("#progress")).to_be_hidden()
    expect(page.locator('#cards .card[data-metric="median_ttft_ms"] .v')).to_have_text("123.5")
    expect(page.locator('#cards .card[data-metric="prefix_cache_hit_rate"] .v')).to_have_text(
        "75.0 %"
    )
    expect(page.locator("#duration")).to_have_text("25 s")
    expect(page.locator("#metrics-client tr[data-metric=median_ttft_ms]")).to_have_count(1)
    expect(page.locator("#log")).to_contain_text("ERROR something to see")
    assert _chart_points(page, "chart-kv") == 5
    assert page.evaluate("window.__sameDocument") is True
    # polling stopped: no further API requests once the run ended
    seen: list[str] = []
    page.on("request", lambda req: seen.append(req.url) if "/api/v1/" in req.url else None)
    page.wait_for_timeout(4500)
    assert seen == []


def test_unknown_run_is_a_404_page(page: Page, live_server: str) -> None:
    allow_console_error(page, "status of 404")
    response = page.goto(f"{live_server}/runs/{uuid.uuid4()}")
    assert response is not None and response.status == 404
    expect(page.locator("h1")).to_have_text("Not found")
    expect(page.locator("p.error")).to_contain_text("No run")


def test_start_time_appears_live(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    src = seeded["real"]["runs"]["apc-on#1"]
    with web_db.begin() as s:
        run = _clone_run(
            s,
            src,
            _experiment(s, "live-start"),
            status="preparing",
            started_at=None,
            finished_at=None,
            progress={"phase": "waiting_health"},
        )
        run_id = run.id
    page.goto(f"{live_server}/runs/{run_id}")
    expect(page.locator("#started")).to_have_text("–")
    with web_db.begin() as s:
        r = s.get(Run, run_id)
        assert r is not None
        r.status, r.started_at = "running", datetime(2026, 11, 30, 18, 0, 5, 250000, tzinfo=UTC)
    expect(page.locator("#started")).to_have_text("2026-11-30 18:00:05 UTC", timeout=10_000)
    with web_db.begin() as s:  # end it, so no other page sees an active run
        r = s.get(Run, run_id)
        assert r is not None
        r.status, r.finished_at = "cancelled", datetime.now(UTC)
