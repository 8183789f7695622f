"""Terminal progress and result tables for experiments (rich), read over the REST API."""

from __future__ import annotations

import math
import time
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from orchestrator.core.auth import client_auth_headers
from orchestrator.core.states import ACTIVE

# (header, metric key, scale, format)
RESULT_COLUMNS: list[tuple[str, str, float, str]] = [
    ("TTFT p50 ms", "median_ttft_ms", 1.0, "{:.1f}"),
    ("TTFT p99 ms", "p99_ttft_ms", 1.0, "{:.1f}"),
    ("TPOT p50 ms", "median_tpot_ms", 1.0, "{:.1f}"),
    ("E2EL p50 ms", "median_e2el_ms", 1.0, "{:.1f}"),
    ("out tok/s", "output_throughput", 1.0, "{:.1f}"),
    ("prefix cache hit rate", "prefix_cache_hit_rate", 100.0, "{:.1f}%"),
    ("KV cache usage peak", "kv_cache_usage_peak", 100.0, "{:.2f}%"),
]


class ReportError(Exception):
    """The API could not be read (unreachable, or an error answer): one line for the user."""


def fetch_experiment(client: httpx.Client, api: str, experiment_id: str) -> dict[str, Any]:
    """``GET /api/v1/experiments/{id}``; raises :class:`ReportError` with the problem's detail."""
    try:
        resp = client.get(f"{api}/api/v1/experiments/{experiment_id}")
    except httpx.HTTPError as exc:
        raise ReportError(f"cannot reach the API at {api}: {exc}") from exc
    if resp.status_code != 200:
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        raise ReportError(f"HTTP {resp.status_code}: {detail}")
    data: dict[str, Any] = resp.json()
    return data


def progress_view(exp: dict[str, Any]) -> Table:
    table = Table(title=f"experiment {exp['name']} ({exp['status']})", expand=False)
    for col in ("run", "rep", "change", "status", "phase", "requests", ""):
        table.add_column(col)
    for run in exp["runs"]:
        prog = run.get("progress") or {}
        done, total = int(prog.get("requests_done", 0)), int(prog.get("requests_total", 0))
        if run["status"] == "succeeded":
            done = total = max(total, 1)
        bar = ProgressBar(total=max(total, 1), completed=done, width=24)
        table.add_row(
            run["name"],
            str(run.get("repeat_index", 0)),
            describe_change(run),
            run["status"] + (" (partial)" if run.get("partial") else ""),
            str(prog.get("phase", "")) if run["status"] in ACTIVE else "",
            f"{done}/{total}" if total else "",
            bar,
        )
    return table


def describe_change(run: dict[str, Any]) -> str:
    if run.get("is_baseline"):
        return "(baseline)"
    return ", ".join(f"{k}={v}" for k, v in (run.get("changes") or {}).items())


def _fmt(metrics: dict[str, float] | None, key: str, scale: float, fmt: str) -> str:
    if not metrics or key not in metrics:
        return "-"
    return fmt.format(metrics[key] * scale)


def result_table(exp: dict[str, Any]) -> Table:
    """One row per run (repeat); the last column compares TTFT p50 with the run's reference
    run (the same repeat of the reference variant)."""
    table = Table(title=f"results: {exp['name']} (model {exp['model_id']})")
    table.add_column("run")
    table.add_column("rep", justify="right")
    table.add_column("change")
    table.add_column("status")
    for header, *_ in RESULT_COLUMNS:
        table.add_column(header, justify="right")
    table.add_column("TTFT p50 vs reference", justify="right")
    metrics = {r["id"]: r.get("metrics") or {} for r in exp["runs"]}
    for run in exp["runs"]:
        m = run.get("metrics") or {}
        ref = metrics.get(run.get("reference_run_id") or "", {})
        ratio = "-"
        if m.get("median_ttft_ms") and ref.get("median_ttft_ms"):
            ratio = ttft_ratio_text(m["median_ttft_ms"], ref["median_ttft_ms"])
        table.add_row(
            run["name"],
            str(run.get("repeat_index", 0)),
            describe_change(run),
            run["status"] + (" (partial)" if run.get("partial") else ""),
            *[_fmt(m, key, scale, fmt) for _, key, scale, fmt in RESULT_COLUMNS],
            ratio,
        )
    return table


def ttft_ratio_text(ttft_ms: float, reference_ms: float) -> str:
    """``"1.46x slower"`` / ``"2.10x faster"`` / ``"same"``: one run's median TTFT vs its reference.

    A single repeat's ratio, for orientation; the comparison endpoint gives the
    verdict with its interval.
    """
    if ttft_ms == reference_ms:
        return "same"
    if ttft_ms < reference_ms:
        return f"{reference_ms / ttft_ms:.2f}x faster"
    return f"{ttft_ms / reference_ms:.2f}x slower"


def watch(
    api: str,
    experiment_id: str,
    *,
    console: Console | None = None,
    interval_s: float = 1.0,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Show live progress until every run of the experiment ends; return the experiment."""
    console = console or Console()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def still_running(exp: dict[str, Any]) -> bool:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"experiment {experiment_id} still running")
        return any(r["status"] in ACTIVE for r in exp["runs"])

    with httpx.Client(timeout=30, headers=client_auth_headers()) as client:
        exp = fetch_experiment(client, api, experiment_id)
        if not console.is_terminal:  # logs and CI: one line per change instead of a live view
            last: dict[str, str] = {}
            while True:
                for run in exp["runs"]:
                    line = progress_line(run)
                    if last.get(run["id"]) != line:
                        console.print(line)
                        last[run["id"]] = line
                if not still_running(exp):
                    return exp
                time.sleep(interval_s)
                exp = fetch_experiment(client, api, experiment_id)
        with Live(progress_view(exp), console=console, refresh_per_second=4) as live:
            while still_running(exp):
                time.sleep(interval_s)
                exp = fetch_experiment(client, api, experiment_id)
                live.update(Group(progress_view(exp)))
    return exp


def progress_line(run: dict[str, Any]) -> str:
    """``run <name> (repeat k): <status> [- <phase> <done>/<total>]`` for non-terminal output."""
    prog = run.get("progress") or {}
    text = f"  run {run['name']} (repeat {run.get('repeat_index', 0)}): {run['status']}"
    if run["status"] in ACTIVE and prog.get("phase"):
        text += f" - {prog['phase']}"
        if prog.get("requests_total"):
            text += f" {prog.get('requests_done', 0)}/{prog['requests_total']} requests"
    return text


KEY_COMPARISONS = (
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_e2el_ms",
    "output_throughput",
    "prefix_cache_hit_rate",
)


def comparison_table(comp: dict[str, Any]) -> Table:
    """Each variant vs its reference: ratio with its interval and the verdict.

    A metric row's interval is the 95 % bootstrap interval of the ratio. Where a
    variant carries ``capacity`` (capacity under SLOs), a ``capacity`` row follows
    its metrics (and a ``capacity per device`` row when the sides reserve
    different device counts): mean capacities, the ratio, its interval labelled
    ``bracket`` (the envelope of the searches' brackets, not a bootstrap; the
    caption says so) and the verdict (``higher`` / ``lower`` / ``no change`` /
    ``unknown`` with the reason).
    """
    table = Table(
        title="comparison (variant / reference; metric interval: 95 % bootstrap CI of the ratio)"
    )
    for col in (
        "variant",
        "vs",
        "changed",
        "metric",
        "reference",
        "variant value",
        "ratio",
        "interval",
        "verdict",
    ):
        table.add_column(
            col, justify="right" if col in ("reference", "variant value", "ratio") else "left"
        )
    chain = {c["variant"]: c for c in comp.get("chain", [])}
    for v in comp.get("variants", []):
        c = chain.get(v["variant"], {})
        changed = f"{v.get('variable')}: {c.get('reference_value')} -> {c.get('variant_value')}"
        for m in v["metrics"]:
            if m["metric"] not in KEY_COMPARISONS:
                continue
            ci = "-"
            if m.get("ci_low") is not None and m.get("ci_of") == "ratio":
                ci = f"[{m['ci_low']:.2f}, {m['ci_high']:.2f}]"
            table.add_row(
                v["variant"],
                v["reference"],
                changed,
                m["metric"],
                f"{m['reference']:.3g}" if m.get("reference") is not None else "-",
                f"{m['variant']:.3g}" if m.get("variant") is not None else "-",
                f"{m['ratio']:.2f}" if m.get("ratio") is not None else "-",
                ci,
                m["verdict"],
            )
            changed = ""
        for row in capacity_rows(v.get("capacity")):
            table.add_row(v["variant"], v["reference"], changed, *row)
            changed = ""
            table.caption = (
                "capacity: highest load meeting every SLO (mean over repeats; unknown unless "
                "every repeat found one); its interval is a bracket, the envelope of the "
                "searches' brackets (highest pass .. lowest fail), not a 95 % CI"
            )
    return table


def _finite(x: Any) -> float | None:
    """A finite number (not a bool), else None."""
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        return None
    return float(x)


def _num(x: Any, fmt: str = "{:.3g}") -> str:
    f = _finite(x)
    return fmt.format(f) if f is not None else "–"


def capacity_rows(cap: dict[str, Any] | None) -> list[tuple[str, ...]]:
    """The comparison table's capacity rows for a variant's ``capacity`` member:
    ``(metric, reference, variant value, ratio, interval, verdict)`` each; none for None.

    Always a ``capacity (<unit>)`` row; a ``capacity per device`` row too when the
    sides reserve different device counts (the per-device ratio then differs)."""
    if not cap:
        return []
    unit = cap.get("unit") or "unknown unit"

    def verdict_text(key: str, ratio_key: str, lo_key: str, hi_key: str) -> str:
        text = str(cap.get(key) or "unknown").replace("_", " ")
        measured = all(_finite(cap.get(k)) is not None for k in (ratio_key, lo_key, hi_key))
        if text != "unknown" and not measured:
            return "unknown (no ratio)"  # never a verdict without the number behind it
        return f"unknown ({cap['reason']})" if text == "unknown" and cap.get("reason") else text

    binding = cap.get("binding_slo") or {}
    metric = f"capacity ({unit})"
    if binding.get("reference") or binding.get("variant"):
        metric += f", binds: {binding.get('reference') or '-'} / {binding.get('variant') or '-'}"

    def interval(lo: Any, hi: Any) -> str:
        flo, fhi = _finite(lo), _finite(hi)
        if flo is None or fhi is None:
            return "–"
        return f"bracket [{flo:.2f}, {fhi:.2f}]"

    rows: list[tuple[str, ...]] = [
        (
            metric,
            _num(cap.get("reference_capacity")),
            _num(cap.get("capacity")),
            _num(cap.get("ratio"), "{:.2f}"),
            interval(cap.get("ci_low"), cap.get("ci_high")),
            verdict_text("verdict", "ratio", "ci_low", "ci_high"),
        )
    ]
    devices = cap.get("devices") or {}
    if devices.get("reference") != devices.get("variant") and cap.get("per_device_ratio"):
        rows.append(
            (
                f"capacity per device ({devices.get('reference')} -> {devices.get('variant')})",
                _num(cap.get("reference_capacity_per_device")),
                _num(cap.get("capacity_per_device")),
                _num(cap.get("per_device_ratio"), "{:.2f}"),
                interval(cap.get("per_device_ci_low"), cap.get("per_device_ci_high")),
                verdict_text(
                    "per_device_verdict",
                    "per_device_ratio",
                    "per_device_ci_low",
                    "per_device_ci_high",
                ),
            )
        )
    return rows


def print_results(
    exp: dict[str, Any], console: Console | None = None, api: str | None = None
) -> None:
    console = console or Console()
    console.print(result_table(exp))
    if api and len(exp.get("variants", [])) > 1:
        resp = httpx.get(
            f"{api}/api/v1/experiments/{exp['id']}/comparison",
            timeout=120,
            headers=client_auth_headers(),
        )
        if resp.status_code == 200:
            comp = resp.json()
            console.print(comparison_table(comp))
            for f in comp.get("findings", []):
                console.print(f"  [yellow]finding[/yellow] {f['variant']}: {f['message']}")
    reuse = exp.get("server_reuse") or {}
    if reuse.get("runs_on_reused_server"):
        console.print(
            f"  server reuse: {reuse['runs_on_reused_server']} run(s) on a running server, "
            f"{reuse['startup_saved_s']:.0f} s of start-up saved"
        )
    for run in exp["runs"]:
        console.print(f"  {run['name']}: {run['url']}  (metrics: {run['url']}/metrics)")
        if run.get("error"):
            console.print(f"    [red]error:[/red] {run['error'][:2000]}")
