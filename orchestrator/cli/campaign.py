"""``vlab campaign``: tuning campaigns (issue 25) over the REST API.

``vlab campaign submit FILE`` posts a campaign document (JSON or YAML, read as ``vlab
submit`` reads a spec) to ``POST /api/v1/campaigns``; ``list``, ``show ID`` and ``cancel
ID`` read and cancel through ``/api/v1/campaigns``. ``show`` prints the status, the path
(each step's variable, from -> to, effect with its interval, verdict and reason), the
candidates, the confirmation and the final configuration as a ``vllm serve`` line and a
re-run spec (from the answer when it carries them, else rebuilt from its ``request`` and
``incumbent`` by :mod:`orchestrator.tuning.final_config`), where the wall time went (a
table: waiting for devices, start-ups, measurement..., with the server starts), the runs
measured again and why (lost to the infrastructure, or a finding flagged the objective),
and for a ``"space": "auto"`` campaign the
space vlab proposed (each variable considered: its levels, or why it was left out).
``VLAB_TOKEN`` is sent as a bearer token when set.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from orchestrator.cli.client import (
    Api,
    WaitTimeout,
    json_on_timeout,
    make_console,
    page_url,
    print_json,
)
from orchestrator.cli.common import ApiOpt, friendly
from orchestrator.cli.report import plain
from orchestrator.cli.specfile import CliError, load_spec_file

campaign_app = typer.Typer(
    help="Tuning campaigns: vlab finds a workload's best configuration one variable at a "
    "time and says what each change bought.",
    no_args_is_help=True,
)
console = make_console()


def _base(api: str | None) -> str:
    return Api(api).base


def _call(method: str, url: str, ok: int = 200, **kw: Any) -> Any:
    """One API call through :class:`orchestrator.cli.client.Api`; its JSON body on
    success, else :class:`orchestrator.cli.client.ApiError` (the problem said once by
    :func:`orchestrator.cli.common.friendly`: exit code 2 for a refusal, 4 when the API is
    unreachable or fails). ``ok`` is kept for the callers' clarity (any 2xx succeeds)."""
    del ok
    return Api(url.split("/api/v1/")[0]).call(
        method,
        url,
        params=kw.get("params"),
        json_body=kw.get("json"),
        timeout_s=kw.get("timeout"),
    )


_one_line_errors = friendly
JsonOpt = Annotated[bool, typer.Option("--json", help="print the API's JSON answer only")]


def level_text(level: Any) -> str:
    """A level as the spec writes it (``true``, ``128``, ``fp8``)."""
    return json.dumps(level) if isinstance(level, bool) else str(level)


def gain_text(gain: dict[str, Any] | None) -> str:
    """``+10.2 % [+7.9 %, +12.6 %]`` from a gain (log ratio, positive is better)."""
    if not gain:
        return "–"
    parts = [math.expm1(gain[k]) * 100 for k in ("estimate", "low", "high")]
    return f"{parts[0]:+.1f} % [{parts[1]:+.1f} %, {parts[2]:+.1f} %]"


def progress_line(body: dict[str, Any]) -> str:
    """``running (round 2): 14 of 32 runs, 1 step adopted, 3 candidates decided``."""
    phase = body.get("phase") or "-"
    decided = [c for c in body.get("candidates") or [] if c.get("outcome") != "measuring"]
    return (
        f"{body.get('status')} ({phase}): {body.get('runs_used', 0)} of "
        f"{body.get('budget', 0)} runs, {len(body.get('path') or [])} step(s) adopted, "
        f"{len(decided)} candidate(s) decided"
    )


def final_of(body: dict[str, Any]) -> dict[str, Any]:
    """``{"serve_command", "spec"}`` of a campaign as the API shows it: its own when the
    answer carries them, else rebuilt from its ``request`` and ``incumbent``."""
    if body.get("serve_command"):
        return {"serve_command": body["serve_command"], "spec": body.get("spec")}
    # deferred: the tuning room (scipy, through the campaigns' decisions: about 1 s), for
    # an answer without its final configuration only
    from orchestrator.tuning.campaign_request import CampaignRequest
    from orchestrator.tuning.final_config import final_result

    try:
        request = CampaignRequest.model_validate(body.get("request") or {})
    except ValidationError:
        return {}
    return final_result(request, dict(body.get("incumbent") or {}))


#: The effect column's header (a literal ``[``: not rich markup).
EFFECT = escape("effect [interval]")


def _cells(*values: Any) -> list[Text]:
    """Table cells as plain text (a reason's ``[...]`` is not rich markup)."""
    return [Text(str(v)) for v in values]


def _fit(table: Table, names: list[str], column: int = 1) -> Table:
    """The table fitted to 100 columns: every cell wraps, the variable's column is as
    wide as its longest name (up to 40), so a name is never cut, and the last column
    (the outcome and its reason) takes the rest."""
    for col in table.columns:
        col.overflow = "fold"
    table.columns[column].min_width = min(max([len(n) for n in names] + [8]), 40)
    table.columns[-1].ratio = 1
    return table


def _step(variable: str, from_level: Any, to_level: Any) -> str:
    """``variable`` over ``from -> to`` (two lines: the name is never wrapped)."""
    return f"{variable}\n{level_text(from_level)} -> {level_text(to_level)}"


def path_table(body: dict[str, Any]) -> Table:
    table = Table("round", "variable: from -> to", EFFECT, "verdict: reason")
    table.columns[2].width = 17
    for s in body.get("path", []):
        reason = s.get("reason", "")
        table.add_row(
            *_cells(
                s["round"],
                _step(s["variable"], s["from_level"], s["to_level"]),
                s.get("effect") or gain_text(s.get("gain")),
                s["verdict"] + (f": {reason}" if reason else ""),
            )
        )
    return _fit(table, [str(s["variable"]) for s in body.get("path", [])])


def candidates_table(body: dict[str, Any]) -> Table:
    table = Table("round", "variable: from -> to", EFFECT, "outcome: reason")
    table.columns[2].width = 17
    for c in body.get("candidates", []):
        verdict = c.get("verdict")
        reason = c.get("reason", "")
        outcome = c["outcome"] + (f" ({verdict})" if verdict and verdict != c["outcome"] else "")
        table.add_row(
            *_cells(
                c["round"],
                _step(c["variable"], c["from_level"], c["to_level"]),
                (c.get("effect") or gain_text(c.get("gain")))
                + (f"\n{c['pairs']} pair(s)" if c.get("pairs") not in (None, "") else ""),
                outcome + (f": {reason}" if reason else ""),
            )
        )
    return _fit(table, [str(c["variable"]) for c in body.get("candidates", [])])


#: The wall-time kinds ``vlab campaign show`` lists, in order, with their row names.
WALL_KINDS = (
    ("queue_wait_s", "waiting for devices"),
    ("startup_s", "engine start-ups"),
    ("warmup_s", "warm-up"),
    ("measure_s", "measurement"),
    ("stop_s", "stopping engines"),
    ("other_s", "other run time"),
    ("lost_s", "runs lost"),
    ("between_s", "between cycles"),
)


def wall_time_table(wall: dict[str, Any]) -> Table:
    """Where the wall time went: each kind's seconds and its share of the elapsed time."""
    table = Table("where", "seconds", "of elapsed")
    elapsed = float(wall.get("elapsed_s") or 0.0)
    for key, name in WALL_KINDS:
        value = float(wall.get(key) or 0.0)
        share = f"{value / elapsed:.0%}" if elapsed > 0 else "–"
        table.add_row(*_cells(name, f"{value:.1f}", share))
    table.add_row(*_cells("elapsed (the campaign)", f"{elapsed:.1f}", "100%"))
    return table


def proposal_table(body: dict[str, Any]) -> Table:
    """The space vlab proposed (``"space": "auto"``): each variable it considered, its
    levels when proposed (as the stored request has them), and why."""
    levels = {
        v.get("name"): v.get("levels") or []
        for v in (body.get("request") or {}).get("space") or []
        if isinstance(v, dict)
    }
    table = Table("variable", "levels", "why")
    for note in body.get("space_proposal") or []:
        shown = (
            ", ".join(level_text(x) for x in levels.get(note["name"], []))
            if note.get("proposed")
            else "left out"
        )
        table.add_row(*_cells(note["name"], shown, note.get("why", "")))
    return _fit(table, [str(n["name"]) for n in body.get("space_proposal") or []], column=0)


def print_costs(body: dict[str, Any], out: Console) -> None:
    """The wall-time table, the server starts, and the runs measured again (each with why:
    lost to the infrastructure, or a finding flagged its objective) or not."""
    wall = body.get("wall_time")
    out.rule("where the wall time went")
    if not wall:
        out.print("nothing recorded yet", markup=False)
    else:
        out.print(wall_time_table(wall))
        out.print(
            f"server starts: {wall.get('server_starts', 0)} "
            f"({wall.get('servers_reused', 0)} run(s) reused a running server); "
            "phases are summed over runs (side by side runs overlap), the wait is wall time",
            markup=False,
        )
    slots = body.get("slots")
    if isinstance(slots, int) and slots > 1:
        out.print(
            f"measured side by side: up to {slots} configurations at once, each on its own "
            "devices, each configuration's pairs of a cycle on one server",
            markup=False,
        )
    reasons = body.get("retry_reasons") or {}
    for label, retry in (body.get("retried") or {}).items():
        why = (reasons.get(label) or {}).get("why")
        again = f"measured again ({why})" if why else "measured again"
        out.print(f"{again}: {label} -> {retry}", markup=False)
    for label, why in (body.get("unmeasured") or {}).items():
        out.print(f"not measured again: {label}: {why}", markup=False)


def print_campaign(body: dict[str, Any], out: Console) -> None:
    """Everything ``vlab campaign show`` prints about one campaign (see the docstring)."""
    objective = (body.get("request") or {}).get("objective") or {}
    out.print(
        f"campaign [bold]{escape(body['name'])}[/bold] ({body['id']}): {body['status']}"
        + (f", {body['phase']}" if body.get("phase") else ""),
    )
    if body.get("status_reason"):
        out.print(f"  {body['status_reason']}", markup=False)
    out.print(
        f"  objective {objective.get('metric', '?')} ({objective.get('direction') or 'default'}),"
        f" {body.get('runs_used', 0)} of {body.get('budget', 0)} runs used",
        markup=False,
    )
    if body.get("url"):
        out.print(f"  {page_url(body['url'])}", markup=False, soft_wrap=True)
    if body.get("space_proposal"):
        out.rule("space proposed by vlab")
        out.print(proposal_table(body))
    out.rule("path (adopted steps)")
    better = {"lower": "lower", "higher": "higher"}.get(str(objective.get("direction")), "")
    out.print(
        "effects are gains: positive is better"
        + (f" ({objective.get('metric', 'the objective')} {better})" if better else ""),
        markup=False,
    )
    if body.get("path"):
        out.print(path_table(body))
    else:
        out.print("no step adopted (yet): the starting configuration stands", markup=False)
    if body.get("cumulative"):
        out.print(f"cumulative gain: {gain_text(body['cumulative'])}", markup=False)
    out.rule("candidates")
    if body.get("candidates"):
        out.print(candidates_table(body))
    else:
        out.print("none decided yet", markup=False)
    out.rule("confirmation")
    conf = body.get("confirmation")
    if conf:
        out.print(
            f"measured total (final vs start): {gain_text(conf['total'])}\n"
            f"product of the step gains:       {gain_text(conf['steps'])}\n"
            f"interaction (the difference):    {gain_text(conf['interaction'])}: "
            + ("agrees with the path" if conf.get("agrees") else "does NOT agree with the path")
            + (
                ""
                if conf.get("agrees")
                else (
                    " (the variables may interact, or the steps read high)"
                    if len(body.get("path") or []) > 1
                    else " (one change: noise or drift between rounds, not an interaction)"
                )
            ),
            markup=False,
        )
    else:
        out.print("not run (yet)", markup=False)
    out.rule("final configuration" if body.get("phase") == "done" else "current incumbent")
    for name, level in (body.get("incumbent") or {}).items():
        start = (body.get("start") or {}).get(name)
        moved = "" if start == level else f"  (from {level_text(start)})"
        out.print(f"  {name} = {level_text(level)}{moved}", markup=False)
    final = final_of(body)
    if final.get("serve_command"):
        out.print("vllm serve line:", markup=False)
        # one line whatever the width: to copy and run
        out.print(f"  {final['serve_command']}", markup=False, soft_wrap=True)
    if final.get("spec"):
        out.print("re-run spec (save as a file, then `vlab submit FILE`):", markup=False)
        out.print(json.dumps(final["spec"], indent=2), markup=False, soft_wrap=True)
    print_costs(body, out)
    if body.get("pending"):
        out.print(f"waiting for {len(body['pending'])} run(s)", markup=False)


@campaign_app.command("submit")
@_one_line_errors
def campaign_submit(
    file: Annotated[
        Path, typer.Argument(exists=True, dir_okay=False, help="JSON or YAML campaign document")
    ],
    api: ApiOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Start a tuning campaign (POST /api/v1/campaigns); the service queues its runs."""
    base = _base(api)
    created = _call(
        "POST", f"{base}/api/v1/campaigns", ok=201, json=load_spec_file(file), timeout=300
    )
    if json_out:
        print_json(created)
        return
    console.print(
        f"campaign [bold]{created['id']}[/bold] ({created['status']}): {page_url(created['url'])}",
        soft_wrap=True,
    )
    console.print(f"follow it with: vlab campaign show {created['id']}", markup=False)


@campaign_app.command("list")
@_one_line_errors
def campaign_list(
    api: ApiOpt = None,
    limit: Annotated[int, typer.Option(min=0, help="at most this many (0: all)")] = 50,
    json_out: JsonOpt = False,
) -> None:
    """List campaigns, newest first (every page, up to --limit)."""
    items = list(Api(api).pages("/api/v1/campaigns", {}, limit or None))
    if json_out:
        print_json(items)
        return
    console.print(list_table(items) if items else "no campaigns")


def list_table(items: list[dict[str, Any]]) -> Table:
    """``vlab campaign list``'s table, within 100 columns: the id and the time whole on
    one line each (never wrapped), the name over its objective (the metric), wrapping at
    the name's spaces."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("id", no_wrap=True, min_width=36)  # whole, to copy
    table.add_column("name / objective", overflow="fold", ratio=1)
    table.add_column("status", no_wrap=True, min_width=9)
    table.add_column("runs", justify="right", no_wrap=True)
    table.add_column("updated", no_wrap=True, min_width=16)
    for item in items:
        table.add_row(
            item["id"],
            Text(f"{item['name']}\n{item.get('objective') or '-'}"),
            item["status"],
            str(item.get("run_count", 0)),
            str(item.get("updated_at", ""))[:16].replace("T", " "),
        )
    return table


@campaign_app.command("show")
@_one_line_errors
def campaign_show(
    campaign_id: Annotated[str, typer.Argument(help="the campaign's id")],
    api: ApiOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="the API's answer as JSON")] = False,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", "-f", help="one progress line while it is queued or running, then all"
        ),
    ] = False,
    interval: Annotated[
        float, typer.Option(min=0.1, help="seconds between two looks with --follow")
    ] = 10.0,
    wait_timeout: Annotated[
        float | None,
        typer.Option(
            "--wait-timeout",
            min=0,
            help="with --follow: give up waiting after this many seconds: exit code 3 "
            "(the campaign keeps going)",
        ),
    ] = None,
) -> None:
    """A campaign: status, path, candidates, confirmation, final configuration. With
    --follow, exit 3 when --wait-timeout passed before it ended."""
    if wait_timeout is not None and not follow:
        raise CliError("--wait-timeout needs --follow (it bounds the wait for the end)")
    deadline = None if wait_timeout is None else time.monotonic() + wait_timeout
    # progress on stderr with --json, so stdout holds the JSON alone
    progress = Console(stderr=True, soft_wrap=True) if as_json else console
    url = f"{_base(api)}/api/v1/campaigns/{campaign_id}"
    with json_on_timeout(as_json):
        body = _follow(url, campaign_id, follow, interval, wait_timeout, deadline, progress)
    if as_json:
        print_json({**body, **final_of(body)})
        return
    print_campaign(body, console)


def _follow(
    url: str,
    campaign_id: str,
    follow: bool,
    interval: float,
    wait_timeout: float | None,
    deadline: float | None,
    progress: Console,
) -> dict[str, Any]:
    """The campaign; with ``follow``, once it ended (a progress line when something
    moved), or :class:`WaitTimeout` (carrying it as it stands) once ``deadline`` passed."""
    body = _call("GET", url, timeout=30)
    last = ""
    while follow and body.get("status") in ("queued", "running"):
        line = progress_line(body)
        if line != last:  # a line when something moved, not one per look
            progress.print(line, markup=False)
            last = line
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(
                    f"--wait-timeout {plain(wait_timeout or 0)} s passed: campaign "
                    f"{campaign_id} is {body.get('status')} (it keeps going; `vlab campaign "
                    f"show {campaign_id} --follow` to wait again)",
                    {**body, **final_of(body)},
                )
            time.sleep(min(interval, left))
        else:
            time.sleep(interval)
        body = _call("GET", url, timeout=30)
    return dict(body)


@campaign_app.command("cancel")
@_one_line_errors
def campaign_cancel(
    campaign_id: Annotated[str, typer.Argument(help="the campaign's id")],
    api: ApiOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Cancel a campaign: its queued runs end cancelled; started runs finish."""
    body = _call("POST", f"{_base(api)}/api/v1/campaigns/{campaign_id}/cancel", timeout=30)
    if json_out:
        print_json(body)
        return
    console.print(f"campaign {body['id']}: {body['status']}", markup=False)
