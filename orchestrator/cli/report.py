"""Terminal progress and result tables for experiments (rich), read over the REST API."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import httpx
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from orchestrator.analysis.trust import RunTrust, SidesTrust, na_text, trust_of_doc
from orchestrator.cli.client import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    ApiError,
    WaitTimeout,
    client_auth_headers,
    page_url,
    problem_lines,
    repeat_number,
    run_label,
)
from orchestrator.cli.tables import LONG_WORD, keep_words, split_columns, verdict_cell
from orchestrator.core.states import ACTIVE

#: Run statuses that make ``vlab submit`` / ``vlab watch`` exit 1.
FAILED_STATUSES = ("failed", "cancelled", "blocked")

# (header, metric key, scale, suffix): values as :func:`plain` writes them (three
# significant figures, whole from 1000), the unit in the header or the suffix
RESULT_COLUMNS: list[tuple[str, str, float, str]] = [
    ("TTFT p50 ms", "median_ttft_ms", 1.0, ""),
    ("TTFT p99 ms", "p99_ttft_ms", 1.0, ""),
    ("TPOT p50 ms", "median_tpot_ms", 1.0, ""),
    ("E2EL p50 ms", "median_e2el_ms", 1.0, ""),
    ("out tok/s", "output_throughput", 1.0, ""),
    ("prefix hit rate", "prefix_cache_hit_rate", 100.0, "%"),
    ("KV usage peak", "kv_cache_usage_peak", 100.0, "%"),
]


class ReportError(Exception):
    """The API could not be read (unreachable, or an error answer): one line for the user."""


def fetch_experiment(client: httpx.Client, api: str, experiment_id: str) -> dict[str, Any]:
    """``GET /api/v1/experiments/{id}``; raises :class:`ApiError` (the problem, said once;
    exit code 2 for a 4xx, 4 when the API is unreachable or fails)."""
    try:
        resp = client.get(f"{api}/api/v1/experiments/{experiment_id}")
    except httpx.HTTPError as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ApiError(
            [f"cannot reach the API at {api}: {reason} (is `vlab up` running?)"],
            EXIT_UNAVAILABLE,
        ) from None
    if resp.status_code != 200:
        raise ApiError(problem_lines(resp), 2 if resp.status_code < 500 else EXIT_UNAVAILABLE)
    data: dict[str, Any] = resp.json()
    return data


def run_outcome(exp: dict[str, Any]) -> int:
    """The exit code an ended experiment gives: 1 when a run failed, was cancelled or was
    blocked (or still runs), else 0."""
    ended_badly = (*FAILED_STATUSES, *ACTIVE)
    return EXIT_FAILED if any(r.get("status") in ended_badly for r in exp["runs"]) else EXIT_OK


def plain(x: Any, unit: str = "") -> str:
    """A number as people write it, never in exponent notation: three significant figures
    (``8``, ``9.95``, ``41.2``, ``312``), whole from 1000 (``1510``), with `` unit`` when
    given; ``–`` for a missing or non-finite value."""
    f = _finite(x)
    if f is None:
        return "–"
    text = f"{f:.0f}" if abs(f) >= 1000 else f"{f:.3g}"
    if "e" in text:  # below 1e-4
        text = f"{f:.10f}".rstrip("0").rstrip(".")
    return f"{text} {unit}" if unit else text


def progress_view(exp: dict[str, Any]) -> Table:
    table = Table(title=f"experiment {exp['name']} ({exp['status']})", expand=False)
    # the run is its variant's name (the change is in the variants table at the end)
    for col in ("run", "status", "phase", "requests", ""):
        table.add_column(col, overflow="fold")
    for run in exp["runs"]:
        prog = run.get("progress") or {}
        done, total = int(prog.get("requests_done", 0)), int(prog.get("requests_total", 0))
        if run["status"] == "succeeded":
            done = total = max(total, 1)
        bar = ProgressBar(total=max(total, 1), completed=done, width=24)
        table.add_row(
            run_label(run),
            run["status"] + (" (partial)" if run.get("partial") else ""),
            str(prog.get("phase", "")) if run["status"] in ACTIVE else "",
            f"{done}/{total}" if total else "",
            bar,
        )
    return table


def describe_change(run: dict[str, Any]) -> str:
    """``engine_args.enable_prefix_caching = true`` (spaces around ``=``, so a narrow
    column wraps between the name and the value, never inside the name)."""
    if run.get("is_baseline"):
        return "(baseline)"
    return ", ".join(f"{k} = {level(v)}" for k, v in (run.get("changes") or {}).items())


def _fmt(
    metrics: dict[str, float] | None,
    key: str,
    scale: float,
    suffix: str,
    trust: RunTrust | None = None,
    mark: str = " (flagged)",
) -> str:
    """A run's metric; ``n/a (off)`` when the run cannot have it; a value a flag of the run
    taints is dimmed and marked ``mark`` (`` (flagged)``; ``*`` in a narrow column, where
    the word would be split) (:mod:`orchestrator.analysis.trust`)."""
    if trust is not None and key in trust.not_applicable:
        return na_text(trust.not_applicable[key])
    if not metrics or key not in metrics:
        return "-"
    text = plain(metrics[key] * scale) + suffix
    if trust is not None and trust.reason(key):
        return f"[dim]{text}{escape(mark)}[/dim]"
    return text


#: Below this many columns the result table's figures get fixed widths (6; 7 for the
#: ratio) and their headers wrap; rich's own shrinking squeezes the run names first.
NARROW_BELOW = 160


def result_table(exp: dict[str, Any], width: int | None = None) -> Table:
    """One row per run (repeat); the last column compares TTFT p50 with the run's reference
    run (the same repeat of the reference variant).

    A value a flag of its run taints (token bursts for TPOT, a warm prefix cache) is
    dimmed and marked ``(flagged)`` (``*`` where the figures are narrow, so that no word
    is split), and gives no ratio (the caption names the flags); the hit rate of a run
    with prefix caching off reads ``n/a (off)``. ``width``: the console's, to fit (no
    vertical rules; fixed figure widths below :data:`NARROW_BELOW`)."""
    table = Table(title=f"results: {exp['name']} (model {exp['model_id']})", box=box.SIMPLE_HEAD)
    runs = exp["runs"]
    longest = max((len(run_label(r)) for r in runs), default=3)
    # fixed widths for the figures (headers wrap at spaces), the rest to the run's name
    narrow = width is not None and width < NARROW_BELOW
    table.add_column("run", overflow="fold", min_width=min(longest, 20))
    table.add_column("status", overflow="fold", min_width=9)
    for header, *_ in RESULT_COLUMNS:
        table.add_column(header, justify="right", overflow="fold", width=6 if narrow else None)
    table.add_column(
        "TTFT p50 vs ref", justify="right", overflow="fold", width=7 if narrow else None
    )
    metrics = {r["id"]: r.get("metrics") or {} for r in exp["runs"]}
    slos = (exp.get("spec") or {}).get("slos")
    trusts = {r["id"]: trust_of_doc(r, slos) for r in exp["runs"]}
    flagged: dict[str, str] = {}
    for run in exp["runs"]:
        m = run.get("metrics") or {}
        trust = trusts[run["id"]]
        ref_id = run.get("reference_run_id") or ""
        ref = metrics.get(ref_id, {})
        ratio = "-"
        if m.get("median_ttft_ms") and ref.get("median_ttft_ms"):
            why = SidesTrust([trust], [trusts[ref_id]] if ref_id in trusts else []).reason(
                "median_ttft_ms"
            )
            ratio = (
                ("[dim]no ratio*[/dim]" if narrow else "[dim]flagged: no ratio[/dim]")
                if why
                else ttft_ratio_text(m["median_ttft_ms"], ref["median_ttft_ms"])
            )
        for _, key, *_rest in RESULT_COLUMNS:
            if m.get(key) is not None and (why := trust.reason(key)):
                flagged.setdefault(run_label(run), why)
        table.add_row(
            run_label(run),
            run["status"] + (" (partial)" if run.get("partial") else ""),
            *[
                _fmt(m, key, scale, suffix, trust, "*" if narrow else " (flagged)")
                for _, key, scale, suffix in RESULT_COLUMNS
            ],
            ratio,
        )
    if flagged:
        table.caption = (
            ("* " if narrow else "")
            + "flagged (no verdict from these values): "
            + "; ".join(f"{name}: {why}" for name, why in flagged.items())
        )
    return table


def variants_table(exp: dict[str, Any]) -> Table:
    """Each variant (by run name, once) and what it changes, the changed variable whole:
    the change column wraps at spaces and is never cut."""
    table = Table(title="variants", expand=False)
    table.add_column("variant", overflow="fold")
    table.add_column("change", overflow="fold", ratio=1)
    seen: set[str] = set()
    for run in exp.get("runs", []):
        if run["name"] in seen:
            continue
        seen.add(run["name"])
        table.add_row(run["name"], describe_change(run))
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
        active = [r for r in exp["runs"] if r["status"] in ACTIVE]
        if active and deadline is not None and time.monotonic() > deadline:
            raise WaitTimeout(
                f"--wait-timeout {plain(timeout_s)} s passed: experiment {experiment_id} has "
                f"{len(active)} of {len(exp['runs'])} run(s) unfinished (they keep going; "
                f"`vlab watch {experiment_id}` to wait again)",
                exp,
            )
        return bool(active)

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
    text = f"  run {run['name']} (repeat {repeat_number(run)}): {run['status']}"
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


def comparison_table(comp: dict[str, Any], width: int | None = None) -> Group:
    """Each variant vs its reference, one table each: ratio with its interval and the
    verdict; the table's title names the variant, its reference and the changed variable
    whole (``apc-on vs baseline: engine_args.enable_prefix_caching false -> true``).

    A metric row's interval is the 95 % bootstrap interval of the ratio. Where a
    variant carries ``capacity`` (capacity under SLOs), a ``capacity`` row follows
    its metrics (and a ``capacity per device`` row when the sides reserve
    different device counts): mean capacities, the ratio, its interval labelled
    ``bracket`` (the envelope of the searches' brackets, not a bootstrap; the
    caption says so) and the verdict (``higher`` / ``lower`` / ``no change`` /
    ``unknown`` with the reason). Values are plain numbers (``1510``, never
    ``1.51e+03``) in the metric's unit (the name's suffix: ``_ms``).
    """
    tables: list[RenderableType] = [
        "comparison (variant / reference; metric interval: 95 % bootstrap CI of the ratio)"
    ]
    chain = {c["variant"]: c for c in comp.get("chain", [])}
    for v in comp.get("variants", []):
        c = chain.get(v["variant"], {})
        title = (
            f"{v['variant']} vs {v['reference']}: {v.get('variable')} "
            f"{level(c.get('reference_value'))} -> {level(c.get('variant_value'))}"
        )
        table = Table(title=title, title_justify="left")
        for col in ("metric", "reference", "variant value", "ratio", "interval", "verdict"):
            table.add_column(
                col,
                justify="right" if col in ("reference", "variant value", "ratio") else "left",
                overflow="fold",
            )
        rows = [metric_row(m) for m in v["metrics"] if m["metric"] in KEY_COMPARISONS]
        notes: list[str] = []
        for row in [*rows, *capacity_rows(v.get("capacity"))]:
            table.add_row(*row[:-1], verdict_cell(row[-1], notes))
        if v.get("capacity"):
            table.caption = (
                "capacity: highest load meeting every SLO (mean over repeats; unknown unless "
                "every repeat found one); its interval is a bracket, the envelope of the "
                "searches' brackets (highest pass .. lowest fail), not a 95 % CI"
            )
        tables.append(keep_words(table, width, cap=LONG_WORD))
        # below the table, where a run's id and a reason's words are never split
        tables += [Text(note) for note in notes]
    return Group(*tables)


def level(value: Any) -> str:
    """A level as a spec writes it: ``true``, ``128``, ``fp8`` (JSON for a bool or None)."""
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)


def metric_row(m: dict[str, Any]) -> tuple[str, ...]:
    """A comparison row's ``(metric, reference, variant value, ratio, interval, verdict)``.

    No verdict from an untrustworthy number: a row flagged for a run (``trustworthy``
    false, verdict ``untrusted``: token bursts for TPOT, a warm prefix cache) shows its
    values dimmed, no ratio, no interval and ``untrusted: <reason>``; a side that cannot
    have the metric reads ``n/a (off)`` and the verdict ``not applicable``. An older
    server's flagged row with a verdict still gets none here."""
    na = m.get("not_applicable") or {}

    def value(side: str) -> str:
        if side in na:
            return na_text(str(na[side]))
        x = _finite(m.get(side))
        return plain(x) if x is not None else "-"

    if m.get("verdict") == "not applicable" or na:
        return (m["metric"], value("reference"), value("variant"), "-", "-", "not applicable")
    if m.get("trustworthy") is False or m.get("verdict") == "untrusted":
        why = escape(str(m.get("untrusted_reason") or "flagged untrustworthy"))
        dim = [f"[dim]{value(side)}[/dim]" for side in ("reference", "variant")]
        return (m["metric"], *dim, "-", "-", f"[dim]untrusted: {why}[/dim]")
    ci = "-"
    lo, hi = _finite(m.get("ci_low")), _finite(m.get("ci_high"))
    if lo is not None and hi is not None and m.get("ci_of") == "ratio":
        ci = f"[{lo:.2f}, {hi:.2f}]"
    ratio = _finite(m.get("ratio"))
    return (
        m["metric"],
        value("reference"),
        value("variant"),
        f"{ratio:.2f}" if ratio is not None else "-",
        ci,
        str(m.get("verdict")),
    )


def _finite(x: Any) -> float | None:
    """A finite number (not a bool), else None."""
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        return None
    return float(x)


def _num(x: Any, fmt: str | None = None) -> str:
    f = _finite(x)
    if f is None:
        return "–"
    return fmt.format(f) if fmt else plain(f)


def _backed(verdict: str, lo: float | None, hi: float | None) -> bool:
    """Whether the interval carries the verdict: higher needs a lower end above 1, lower an
    upper end below 1, no change both ends around 1 (one-sided verdicts have one end)."""
    if verdict == "higher":
        return lo is not None and lo > 1.0
    if verdict == "lower":
        return hi is not None and hi < 1.0
    if verdict == "no_change":
        return lo is not None and hi is not None and lo <= 1.0 <= hi
    return False


def capacity_rows(cap: dict[str, Any] | None) -> list[tuple[str, ...]]:
    """The comparison table's capacity rows for a variant's ``capacity`` member:
    ``(metric, reference, variant value, ratio, interval, verdict)`` each; none for None.

    Always a ``capacity (<unit>)`` row; a ``capacity per device`` row too when the
    sides reserve different device counts (the per-device ratio then differs). A side
    that found only a bound shows it (``at least 24``, ``below 1``) and the interval is
    one-sided (``at least 2.86 (one-sided)``); the verdict is the document's
    ``statement`` (``higher: at least 2.86x``) and never stands without the end of the
    interval that carries it (``unknown (no ratio)``); ``untrusted`` names the flag."""
    if not cap:
        return []
    unit = cap.get("unit") or "unknown unit"
    raw_bounds = cap.get("bounds")
    bounds: dict[str, Any] = raw_bounds if isinstance(raw_bounds, dict) else {}

    def verdict_text(key: str, lo_key: str, hi_key: str, statement_key: str) -> str:
        text = str(cap.get(key) or "unknown")
        if text == "untrusted":
            return f"untrusted ({escape(str(cap.get('untrusted_reason') or 'flagged'))})"
        if text in ("higher", "lower", "no_change"):
            if not _backed(text, _finite(cap.get(lo_key)), _finite(cap.get(hi_key))):
                return "unknown (no ratio)"  # never a verdict without the number behind it
            return str(cap.get(statement_key) or text.replace("_", " "))
        return f"unknown ({escape(str(cap['reason']))})" if cap.get("reason") else "unknown"

    def side(value_key: str, bound_key: str) -> str:
        if _finite(cap.get(value_key)) is not None or bound_key not in bounds:
            return _num(cap.get(value_key))
        return str(bounds[bound_key])

    binding = cap.get("binding_slo") or {}
    metric = f"capacity ({unit})"
    if binding.get("reference") or binding.get("variant"):
        metric += f", binds: {binding.get('reference') or '-'} / {binding.get('variant') or '-'}"

    def interval(lo: Any, hi: Any) -> str:
        flo, fhi = _finite(lo), _finite(hi)
        if flo is not None and fhi is not None:
            return f"bracket [{flo:.2f}, {fhi:.2f}]"
        if flo is not None:
            return f"at least {flo:.2f} (one-sided)"
        if fhi is not None:
            return f"at most {fhi:.2f} (one-sided)"
        return "–"

    rows: list[tuple[str, ...]] = [
        (
            metric,
            side("reference_capacity", "reference"),
            side("capacity", "variant"),
            _num(cap.get("ratio"), "{:.2f}"),
            interval(cap.get("ci_low"), cap.get("ci_high")),
            verdict_text("verdict", "ci_low", "ci_high", "statement"),
        )
    ]
    devices = cap.get("devices") or {}
    per_device = cap.get("per_device_ratio") or cap.get("per_device_statement")
    if devices.get("reference") != devices.get("variant") and per_device:
        rows.append(
            (
                f"capacity per device ({devices.get('reference')} -> {devices.get('variant')})",
                _num(cap.get("reference_capacity_per_device")),
                _num(cap.get("capacity_per_device")),
                _num(cap.get("per_device_ratio"), "{:.2f}"),
                interval(cap.get("per_device_ci_low"), cap.get("per_device_ci_high")),
                verdict_text(
                    "per_device_verdict",
                    "per_device_ci_low",
                    "per_device_ci_high",
                    "per_device_statement",
                ),
            )
        )
    return rows


def run_capacity_table(exp: dict[str, Any]) -> Table | None:
    """Each run's capacity search in words (None when no run searched): status, capacity
    or the bound it showed, the binding SLO (``saturated`` only with the server's
    evidence), client-limited steps and the load generator's ceiling."""
    runs = [r for r in exp.get("runs", []) if isinstance(r.get("capacity"), dict)]
    if not runs:
        return None
    table = Table(title="capacity under SLOs, per run")
    for col in ("run", "rep", "status", "capacity", "binds", "load generator"):
        table.add_column(col)
    for run in runs:
        doc = run["capacity"]
        unit = CAPACITY_UNITS.get(str(doc.get("variable")), "")
        lo, hi = (list(doc.get("interval") or []) + [None, None])[:2]
        status = str(doc.get("status") or "-")
        cap = _finite(doc.get("capacity"))
        if status == "found" and cap is not None:
            shown = plain(cap, unit)
        elif status in ("at_least_max", "client_limited") and _finite(lo) is not None:
            shown = f"at least {plain(lo, unit)}"
        elif status == "below_min" and _finite(hi) is not None:
            shown = f"below {plain(hi, unit)}"
        else:
            shown = "unknown"
        steps = [s for s in doc.get("steps") or [] if isinstance(s, dict)]
        limited = [s for s in steps if s.get("verdict") == "client_limited"]
        ceiling = _finite(doc.get("client_ceiling"))
        client = []
        if ceiling is not None:
            client.append(f"ceiling here {plain(ceiling, 'req/s')}")
        if limited:
            client.append(f"{len(limited)} client-limited step(s): no verdict from them")
        table.add_row(
            run["name"],
            str(repeat_number(run)),
            status.replace("_", " "),
            shown,
            _binding(doc, steps),
            "; ".join(client) or "-",
        )
    return table


#: The unit of a capacity, by search variable.
CAPACITY_UNITS = {"request_rate": "req/s", "concurrency": "concurrent requests"}


def _binding(doc: dict[str, Any], steps: list[dict[str, Any]]) -> str:
    """The binding SLO; ``saturated`` says the server saturated only with its evidence."""
    binding = doc.get("binding_slo")
    if binding != "saturated":
        return str(binding or "-")
    for s in steps:
        evidence = s.get("saturation_evidence")
        if s.get("saturated") and isinstance(evidence, list) and evidence:
            return "server saturated: " + "; ".join(str(e) for e in evidence)
    return "saturation signal without server evidence"


def print_results(
    exp: dict[str, Any], console: Console | None = None, api: str | None = None
) -> None:
    console = console or Console()
    console.print(variants_table(exp))
    console.print(*split_columns(result_table(exp, console.width), console.width))
    capacity = run_capacity_table(exp)
    if capacity is not None:
        console.print(capacity)
    if api and len(exp.get("variants", [])) > 1:
        resp = httpx.get(
            f"{api}/api/v1/experiments/{exp['id']}/comparison",
            timeout=120,
            headers=client_auth_headers(),
        )
        if resp.status_code == 200:
            comp = resp.json()
            console.print(comparison_table(comp, console.width))
            for f in comp.get("findings", []):
                console.print(f"  [yellow]finding[/yellow] {f['variant']}: {f['message']}")
    reuse = exp.get("server_reuse") or {}
    if reuse.get("runs_on_reused_server"):
        console.print(
            f"  server reuse: {reuse['runs_on_reused_server']} run(s) on a running server, "
            f"{reuse['startup_saved_s']:.0f} s of start-up saved"
        )
    for run in exp["runs"]:
        number = repeat_number(run)
        line = f"  {run['name']} #{number}: {page_url(run['url'])}"
        console.print(line, markup=False, soft_wrap=True)  # a link whole, to open
        if run.get("error"):
            console.print(f"    [red]error:[/red] {run['error'][:2000]}")
