"""``vlab runs``, ``vlab experiments``, ``vlab compare`` and ``vlab schedules``: the run
history, experiments, comparisons and scheduled sweeps, read and changed through the
REST API (:class:`orchestrator.cli.client.Api`), never the database.

Every command takes ``--json`` (the API's answer as it is: a list command prints a JSON
array of the list's items, every page followed) and ``--api``. ``vlab compare`` exits 1
when a variant is worse than its reference past the regression floor (a metric's verdict
``worse``, or capacity ``lower``, by at least ``--min-change`` percent, 5 by default:
:mod:`orchestrator.analysis.regression`); ``vlab schedules fires`` exits 1 when the
newest compared fire of a sweep found regressions. The shapes and exit codes are in
docs/USAGE.md ("The command line as an API client").
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from orchestrator.analysis.regression import (
    MIN_CHANGE,
    capacity_is_regression,
    capacity_size,
    drop,
    floor_drop,
    is_regression,
    percent,
    percents_apart,
)
from orchestrator.analysis.trust import finite_number
from orchestrator.cli.client import (
    EXIT_FAILED,
    Api,
    check_uuid,
    make_console,
    page_url,
    print_json,
    repeat_number,
    run_label,
    say_unsuccessful,
)
from orchestrator.cli.common import ApiOpt, friendly
from orchestrator.cli.report import (
    comparison_table,
    describe_change,
    plain,
    print_results,
)
from orchestrator.cli.specfile import CliError, load_spec_file
from orchestrator.cli.tables import keep_words

console = make_console()

JsonOpt = Annotated[bool, typer.Option("--json", help="print the API's JSON answer only")]
LimitOpt = Annotated[
    int, typer.Option("--limit", min=0, help="at most this many (0: all, every page)")
]

runs_app = typer.Typer(help="The run history: list (filters, sorts), show, cancel.")
experiments_app = typer.Typer(help="Experiments: list, show (the result tables).")
schedules_app = typer.Typer(
    help="Scheduled sweeps and campaigns: list, show, fires, create, pause, resume, delete."
)


def when(value: Any) -> str:
    """``2026-12-07 01:05`` from an ISO 8601 date-time (UTC as the API gives it)."""
    return str(value)[:16].replace("T", " ") if value else "–"


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, overflow="fold")
    return table


# ----------------------------------------------------------------------------- runs


def runs_table(items: list[dict[str, Any]], width: int) -> Table:
    """One row per run: its name and id, status, change, TTFT p50; the id whole under the
    name (to copy for ``runs show``), the changed variable whole (the change wraps at its
    spaces, a long run name wraps, nothing is cut). Where the four columns do not fit
    ``width`` (a terminal narrower than the id, the status, the longest changed
    variable's name and the TTFT), the change goes under the id, in the first column."""
    change_width = max(
        min(max([len(k) for r in items for k in r.get("changes") or {}] + [0]), 40), 10
    )
    # a campaign's run name is one word (``engine_args.max_num_seqs=128``): whole too
    first_width = max([36] + [len(w) for r in items for w in run_label(r).split()])
    # the columns' widths, a space either side of each but the outer ones, and the rules
    split = first_width + 9 + change_width + 7 + 2 * 3 + 5 <= width
    table = Table(title="runs", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("run / id" if split else "run / id / change", min_width=first_width)
    table.add_column("status", min_width=9)
    if split:
        table.add_column("change", min_width=change_width)
    table.add_column("TTFT p50 ms", justify="right", width=7)
    for col in table.columns:
        col.overflow = "fold"  # wrap at spaces; only a word longer than its column folds
    for r in items:
        first = f"{run_label(r)}\n{r['id']}"
        change = describe_change(r)
        ttft = plain((r.get("metrics") or {}).get("median_ttft_ms"))
        if split:
            table.add_row(Text(first), r["status"], Text(change), ttft)
        else:
            table.add_row(Text(f"{first}\n{change}"), r["status"], ttft)
    return table


@runs_app.command("list")
@friendly
def runs_list(
    experiment_id: Annotated[
        str | None, typer.Option(help="the runs of one experiment (its id)", callback=check_uuid)
    ] = None,
    status: Annotated[
        str | None, typer.Option(help="queued, preparing, running, succeeded, failed, ...")
    ] = None,
    model: Annotated[str | None, typer.Option(help="model id, exact")] = None,
    experiment: Annotated[
        str | None, typer.Option(help="experiment id, or part of its name")
    ] = None,
    engine_arg: Annotated[
        str | None,
        typer.Option(help="name=value, value read as JSON: enable_prefix_caching=true"),
    ] = None,
    since: Annotated[str | None, typer.Option(help="submitted at or after (ISO 8601)")] = None,
    until: Annotated[str | None, typer.Option(help="submitted before (ISO 8601)")] = None,
    sort: Annotated[
        str | None,
        typer.Option(
            help="submitted, sequence, started, duration, experiment, model, status, "
            "variable, ttft_p50, ttft_p99, e2el_p50, output_throughput, hit_rate"
        ),
    ] = None,
    order: Annotated[str | None, typer.Option(help="asc or desc")] = None,
    limit: LimitOpt = 50,
    json_out: JsonOpt = False,
    api: ApiOpt = None,
) -> None:
    """The run history (GET /api/v1/runs): filtered, sorted, newest first by default."""
    params = {
        "experiment_id": experiment_id,
        "status": status,
        "model": model,
        "experiment": experiment,
        "engine_arg": engine_arg,
        "since": since,
        "until": until,
        "sort": sort,
        "order": order,
    }
    items = list(Api(api).pages("/api/v1/runs", params, limit or None))
    if json_out:
        print_json(items)
        return
    table = runs_table(items, console.width)
    console.print(table if items else "no runs match")


@runs_app.command("show")
@friendly
def runs_show(run_id: str, json_out: JsonOpt = False, api: ApiOpt = None) -> None:
    """One run (GET /api/v1/runs/{id}): status, change, metrics, its findings
    (GET /api/v1/runs/{id}/findings; not with --json, which is the run as it is), error."""
    client = Api(api)
    run = client.get(f"/api/v1/runs/{run_id}")
    if json_out:
        print_json(run)
        return
    console.print(
        f"run {run['name']} (repeat {repeat_number(run)}) of experiment "
        f"{run['experiment_id']}: {run['status']}"
        + (f" ({run['status_reason']})" if run.get("status_reason") else ""),
        markup=False,
    )
    console.print(f"  change: {describe_change(run) or '-'}", markup=False)
    console.print(f"  model: {run['model_id']}  vLLM: {run.get('vllm_version') or '-'}")
    metrics = run.get("metrics") or {}
    if metrics:
        table = _table("metrics", "metric", "value")
        for key, value in sorted(metrics.items()):
            table.add_row(key, metric_text(key, value))
        console.print(table)
    findings = client.get(f"/api/v1/runs/{run_id}/findings").get("findings") or []
    console.print("  findings:" if findings else "  findings: none", markup=False)
    for f in findings:
        console.print(f"    {f['severity']} {f['code']}: {f['message']}", markup=False)
    if run.get("error"):
        console.print(f"  error: {' '.join(str(run['error']).split())[:2000]}", markup=False)
    console.print(f"  {page_url(run['url'])}", markup=False, soft_wrap=True)


#: Metrics that are fractions, shown as percentages (as the result table shows them).
FRACTIONS = ("prefix_cache_hit_rate", "kv_cache_usage_mean", "kv_cache_usage_peak")


def metric_text(key: str, value: Any) -> str:
    """A run's metric with its unit, as the tables write it: ``42.9 ms``, ``3.91 s``,
    ``65.4 tok/s``, ``4.09 req/s``, ``90.2%`` (a hit rate or a cache usage); counts bare."""
    if key in FRACTIONS or key.endswith("_fraction"):
        return plain(value * 100) + "%" if isinstance(value, int | float) else plain(value)
    base = key.removesuffix("_per_device")
    if base.endswith("_ms"):
        unit = "ms"
    elif base == "duration" or base.endswith("_s"):
        unit = "s"
    elif base in ("request_throughput", "request_goodput", "goodput"):
        unit = "req/s"
    elif base.endswith("_throughput"):
        unit = "tok/s"
    else:
        unit = ""
    if unit and base != key:
        unit += " per device"
    return plain(value, unit)


@runs_app.command("cancel")
@friendly
def runs_cancel(run_id: str, json_out: JsonOpt = False, api: ApiOpt = None) -> None:
    """Cancel a run (POST /api/v1/runs/{id}/cancel): a queued run at once, a running one
    at its next check."""
    run = Api(api).call("POST", f"/api/v1/runs/{run_id}/cancel")
    if json_out:
        print_json(run)
        return
    console.print(f"run {run['id']}: {run['status']} (cancel requested)", markup=False)


# ----------------------------------------------------------------------------- experiments


@experiments_app.command("list")
@friendly
def experiments_list(limit: LimitOpt = 50, json_out: JsonOpt = False, api: ApiOpt = None) -> None:
    """Experiments, newest first (GET /api/v1/experiments)."""
    items = list(Api(api).pages("/api/v1/experiments", {}, limit or None))
    if json_out:
        print_json(items)
        return
    # the name over the id (whole on its line, to copy): fits 70 columns as well as 100
    table = Table(
        title="experiments",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
    )
    table.add_column("experiment / id", min_width=36, overflow="fold")
    table.add_column("model", overflow="fold")
    table.add_column("created", overflow="fold")
    table.add_column("status / runs", overflow="fold")
    for e in items:
        table.add_row(
            Text(f"{e['name']}\n{e['id']}"),
            Text(e["model_id"]),
            when(e["created_at"]),
            f"{e['status']}\n{e['run_count']} run(s)",
        )
    console.print(keep_words(table, console.width) if items else "no experiments")


@experiments_app.command("show")
@friendly
def experiments_show(experiment_id: str, json_out: JsonOpt = False, api: ApiOpt = None) -> None:
    """An experiment's variants, result table, comparison and run links
    (GET /api/v1/experiments/{id}). Exits 1 when a run failed, was cancelled or blocked."""
    client = Api(api)
    exp = client.get(f"/api/v1/experiments/{experiment_id}")
    if json_out:
        print_json(exp)
    else:
        print_results(exp, console, client.base)
    if any(r["status"] in ("failed", "cancelled", "blocked") for r in exp.get("runs", [])):
        say_unsuccessful(exp)
        raise typer.Exit(EXIT_FAILED)


# ----------------------------------------------------------------------------- compare


#: ``(<variant> <metric>, worse | lower, its direction, its ratio, a regression?)``.
Worse = tuple[str, str, str, float | None, bool]


def _worse(comp: dict[str, Any], min_change: float) -> list[Worse]:
    """``(<variant> <metric>, worse | lower, its direction, its point ratio (a capacity's
    :func:`capacity_size`), a regression?)`` for each metric whose verdict is ``worse``
    and each capacity ``lower``; whether it is a regression is
    :mod:`orchestrator.analysis.regression`'s rule (the floor)."""
    out: list[Worse] = []
    for v in comp.get("variants", []):
        for m in v.get("metrics", []):
            if m.get("verdict") == "worse":
                d, ratio = str(m.get("direction")), finite_number(m.get("ratio"))
                past = is_regression(d, "worse", ratio, min_change)
                out.append((f"{v['variant']} {m['metric']}", "worse", d, ratio, past))
        cap = v.get("capacity") or {}
        if cap.get("verdict") == "lower":
            ratio, high = finite_number(cap.get("ratio")), finite_number(cap.get("ci_high"))
            past = capacity_is_regression("lower", ratio, high, min_change)
            size = capacity_size(ratio, high)
            out.append((f"{v['variant']} capacity", "lower", "higher_is_better", size, past))
    return out


def _sized(word: str, direction: str, ratio: float | None, min_change: float | None) -> str:
    """``worse by 30.0 %``: the verdict and its size as a person reads it (the rise of a
    lower-is-better metric, the drop of a higher-is-better one: :func:`orchestrator.
    analysis.regression.drop`), never negative (``worse (its point ratio is on the good
    side of 1)``); with ``min_change`` (a size under that floor) as many decimals as it
    takes never to read as the floor (``4.96 %``, not ``5.0 %``)."""
    size = drop(direction, ratio)
    if size is None:
        return word
    if size < 0:
        return f"{word} (its point ratio is on the good side of 1)"
    if min_change is None:
        return f"{word} by {percent(size)}"
    return f"{word} by {percents_apart(size, floor_drop(direction, min_change))[0]}"


def regressions(comp: dict[str, Any], min_change: float = MIN_CHANGE) -> list[str]:
    """``<variant> <metric>: worse by 30.0 %`` for each metric a variant made worse than
    its reference past the regression floor (verdict ``worse``, or a capacity verdict
    ``lower``, by at least ``min_change``: :func:`orchestrator.analysis.regression.
    is_regression`): what makes ``vlab compare`` exit 1."""
    return [
        f"{name}: {_sized(word, d, ratio, None)}"
        for name, word, d, ratio, past in _worse(comp, min_change)
        if past
    ]


def under_floor(comp: dict[str, Any], min_change: float = MIN_CHANGE) -> list[str]:
    """``<variant> median_tpot_ms worse by 0.2 %: under the 5 % regression floor, not a
    regression``, for each worse verdict the floor keeps from being a regression; for a
    higher-is-better metric the drop the floor is follows it (``(a drop of 4.8 % here)``)."""
    lines = []
    for name, word, d, ratio, past in _worse(comp, min_change):
        if past:
            continue
        floor = f"{percent(min_change)} regression floor"
        if d == "higher_is_better":
            size, at = drop(d, ratio), floor_drop(d, min_change)
            shown = percents_apart(size, at)[1] if size is not None and size >= 0 else None
            floor += f" (a drop of {shown or percent(at)} here)"
        lines.append(
            f"{name} {_sized(word, d, ratio, min_change)}: under the {floor}, not a regression"
        )
    return lines


def no_verdict(comp: dict[str, Any]) -> list[str]:
    """``no verdict for apc-on: every metric is untrusted or not applicable, so this
    comparison checked nothing``, for each variant none of whose metrics (nor its
    capacity) has a verdict: a green exit code from it rests on no evidence."""
    lines = []
    for v in comp.get("variants", []):
        metrics = v.get("metrics") or []
        cap = v.get("capacity") or {}
        if all(
            m.get("verdict") in ("untrusted", "not applicable") or m.get("trustworthy") is False
            for m in metrics
        ) and (not cap or cap.get("verdict") in ("untrusted", "unknown")):
            lines.append(
                f"no verdict for {v['variant']}: every metric is untrusted or not "
                "applicable, so this comparison checked nothing"
            )
    return lines


#: The largest --min-change (percent): a floor above it would make every change pass.
MAX_MIN_CHANGE = 1000.0


@friendly
def compare(
    experiment_id: Annotated[str, typer.Argument(help="the experiment")],
    json_out: JsonOpt = False,
    api: ApiOpt = None,
    min_change: Annotated[
        float,
        typer.Option(
            "--min-change",
            metavar="PCT",
            help="the regression floor in percent, 0 to 1000: a worse verdict smaller than "
            "this is no regression (0: every worse verdict is one)",
        ),
    ] = 100.0 * MIN_CHANGE,
) -> None:
    """Each variant vs its reference (GET /api/v1/experiments/{id}/comparison): ratio,
    95 % interval, verdict. Exits 1 when a variant is worse by at least --min-change
    percent (a regression); a smaller worse change is said below the table, not a
    regression; so is a variant with no verdict at all (every metric untrusted or not
    applicable)."""
    if not (math.isfinite(min_change) and 0.0 <= min_change <= MAX_MIN_CHANGE):
        raise CliError(f"--min-change must be a percent from 0 to {MAX_MIN_CHANGE:.0f}")
    comp = Api(api).call("GET", f"/api/v1/experiments/{experiment_id}/comparison", timeout_s=300)
    found = regressions(comp, min_change / 100.0)
    if json_out:
        print_json(comp)
    else:
        console.print(comparison_table(comp, console.width))
        for f in comp.get("findings", []):
            console.print(f"  finding {f['variant']}: {f['message']}", markup=False)
        for line in under_floor(comp, min_change / 100.0):
            console.print(line, markup=False)
        for line in found:
            console.print(f"regression: {line}", markup=False)
        for line in no_verdict(comp):
            console.print(line, markup=False)
    if found:
        raise typer.Exit(EXIT_FAILED)


# ----------------------------------------------------------------------------- schedules


def _schedule_line(s: dict[str, Any]) -> str:
    state = "enabled" if s["enabled"] else "paused"
    nxt = (s.get("next_fire_times") or [None])[0]
    return (
        f"schedule {s['name']} ({s['id']}): {s['kind']}, cron {s['cron']!r} {s['timezone']}, "
        f"{state}, next {when(nxt)}"
    )


@schedules_app.command("list")
@friendly
def schedules_list(limit: LimitOpt = 50, json_out: JsonOpt = False, api: ApiOpt = None) -> None:
    """Schedules, newest first (GET /api/v1/schedules)."""
    items = list(Api(api).pages("/api/v1/schedules", {}, limit or None))
    if json_out:
        print_json(items)
        return
    # the id whole under the name (to copy); the fire times under each other
    table = _table(
        "schedules", "schedule / id", "kind", "cron / timezone", "state", "next / last fire"
    )
    table.columns[0].min_width = 36
    table.columns[-1].min_width = 16  # a time on one line
    for s in items:
        table.add_row(
            Text(f"{s['name']}\n{s['id']}"),
            s["kind"],
            Text(f"{s['cron']}\n{s['timezone']}"),
            "enabled" if s["enabled"] else "paused",
            f"{when((s.get('next_fire_times') or [None])[0])}\n{when(s.get('last_fire_at'))}",
        )
    console.print(keep_words(table, console.width) if items else "no schedules")


@schedules_app.command("show")
@friendly
def schedules_show(schedule_id: str, json_out: JsonOpt = False, api: ApiOpt = None) -> None:
    """One schedule (GET /api/v1/schedules/{id}): next fire times, latest fires."""
    s = Api(api).get(f"/api/v1/schedules/{schedule_id}")
    if json_out:
        print_json(s)
        return
    console.print(_schedule_line(s), markup=False)
    for f in s.get("recent_fires") or []:
        console.print(
            f"  {when(f['fire_time'])}: {f['status']}"
            + (f", experiment {f['experiment_id']}" if f.get("experiment_id") else "")
            + (f" ({f['detail']})" if f.get("detail") else ""),
            markup=False,
        )


@schedules_app.command("fires")
@friendly
def schedules_fires(
    schedule_id: str, limit: LimitOpt = 20, json_out: JsonOpt = False, api: ApiOpt = None
) -> None:
    """A schedule's fires, newest first, with each sweep's regressions against the
    previous completed sweep (GET /api/v1/schedules/{id}/fires). Exits 1 when the newest
    compared fire found a regression."""
    fires = list(Api(api).pages(f"/api/v1/schedules/{schedule_id}/fires", {}, limit or None))
    newest = next((f for f in fires if f.get("comparison") == "compared"), None)
    if json_out:
        print_json(fires)
    else:
        table = _table("fires", "fire time", "status", "experiment", "comparison", "regressions")
        for f in fires:
            regs = "; ".join(
                f"{r['variant']} {r['metric']}: "
                + (r.get("statement") or f"{plain(r.get('ratio'))}x")
                for r in f.get("regressions") or []
            )
            table.add_row(
                when(f["fire_time"]),
                f["status"],
                f.get("experiment_id") or "–",
                f.get("comparison") or "–",
                regs or "none",
            )
        console.print(keep_words(table, console.width) if fires else "no fires yet")
    if newest is not None and newest.get("regressions"):
        raise typer.Exit(EXIT_FAILED)


@schedules_app.command("create")
@friendly
def schedules_create(
    file: Annotated[
        Path,
        typer.Argument(
            exists=True,
            dir_okay=False,
            help="JSON or YAML: name, cron, timezone, template (a spec) or campaign, ...",
        ),
    ],
    json_out: JsonOpt = False,
    api: ApiOpt = None,
) -> None:
    """Store a schedule (POST /api/v1/schedules) from a file as the API takes it."""
    body = load_spec_file(file)
    s = Api(api).call("POST", "/api/v1/schedules", json_body=body, timeout_s=300)
    if json_out:
        print_json(s)
        return
    console.print(_schedule_line(s), markup=False)


def _set_enabled(schedule_id: str, enabled: bool, json_out: bool, api: str | None) -> None:
    s = Api(api).call("PATCH", f"/api/v1/schedules/{schedule_id}", json_body={"enabled": enabled})
    if json_out:
        print_json(s)
        return
    console.print(_schedule_line(s), markup=False)


@schedules_app.command("pause")
@friendly
def schedules_pause(schedule_id: str, json_out: JsonOpt = False, api: ApiOpt = None) -> None:
    """Stop a schedule firing (PATCH enabled=false)."""
    _set_enabled(schedule_id, False, json_out, api)


@schedules_app.command("resume")
@friendly
def schedules_resume(schedule_id: str, json_out: JsonOpt = False, api: ApiOpt = None) -> None:
    """Let a schedule fire again, from now on (PATCH enabled=true; missed times are not
    caught up)."""
    _set_enabled(schedule_id, True, json_out, api)


@schedules_app.command("delete")
@friendly
def schedules_delete(schedule_id: str, json_out: JsonOpt = False, api: ApiOpt = None) -> None:
    """Delete a schedule and its fire records (its experiments stay)."""
    Api(api).call("DELETE", f"/api/v1/schedules/{schedule_id}")
    if json_out:
        print_json({"id": schedule_id, "deleted": True})
        return
    console.print(f"schedule {schedule_id} deleted", markup=False)
