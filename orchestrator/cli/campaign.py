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

import functools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from pydantic import ValidationError
from pydantic_settings import SettingsError
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from orchestrator.cli.specfile import CliError, load_spec_file
from orchestrator.core.auth import client_auth_headers
from orchestrator.core.settings import Settings, get_settings
from orchestrator.tuning.campaign_request import CampaignRequest
from orchestrator.tuning.final_config import final_result

campaign_app = typer.Typer(
    help="Tuning campaigns: vlab finds a workload's best configuration one variable at a "
    "time and says what each change bought.",
    no_args_is_help=True,
)
console = Console() if sys.stdout.isatty() else Console(width=200, soft_wrap=True)

ApiOpt = Annotated[str | None, typer.Option("--api", help="API base URL (default from settings)")]


def _one_line_errors(func: Callable[..., None]) -> Callable[..., None]:
    """A :class:`CliError`, or settings that do not load, as one line on stderr and exit
    code 2 (no traceback)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            func(*args, **kwargs)
        except (CliError, SettingsError, ValidationError) as exc:
            if isinstance(exc, ValidationError) and exc.title != Settings.__name__:
                raise
            said = str(exc) if isinstance(exc, CliError) else f"invalid settings: {exc}"
            Console(stderr=True, soft_wrap=True).print(
                f"[red]error:[/red] {escape(' '.join(said.split()))}", markup=True
            )
            raise typer.Exit(2) from None

    return wrapper


def _base(api: str | None) -> str:
    return (api or get_settings().api_base_url()).rstrip("/")


def _call(method: str, url: str, ok: int = 200, **kw: Any) -> Any:
    """One API call; its JSON body when the status is ``ok``, else the problem printed
    (every bad field listed) and exit code 1; an unreachable API is a :class:`CliError`."""
    kw["headers"] = {**client_auth_headers(), **(kw.get("headers") or {})}
    try:
        resp = httpx.request(method, url, **kw)
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the API at {url}: {exc} (is `vlab up` running?)") from exc
    if resp.status_code == ok:
        return resp.json()
    try:
        body = resp.json()
    except ValueError:
        console.print(f"HTTP {resp.status_code}: {resp.text}", markup=False)
        raise typer.Exit(1) from None
    errors = body.get("errors", []) or []
    # the detail restates the errors when there are some: each is said once, below
    said = f"{len(errors)} problem(s)" if errors else str(body.get("detail"))
    console.print(
        f"[red]{escape(str(body.get('title', 'error')))}[/red] ({resp.status_code}): {escape(said)}"
    )
    for err in errors:
        loc = ".".join(map(str, err.get("loc", [])))
        console.print(f"  - {loc}: {err.get('msg')}", markup=False)
    if resp.status_code == 401:
        console.print("  set VLAB_TOKEN to an operator token (`vlab token create`)", markup=False)
    raise typer.Exit(1)


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


def path_table(body: dict[str, Any]) -> Table:
    table = Table("round", "variable", "from -> to", EFFECT, "verdict", "reason")
    for s in body.get("path", []):
        table.add_row(
            *_cells(
                s["round"],
                s["variable"],
                f"{level_text(s['from_level'])} -> {level_text(s['to_level'])}",
                s.get("effect") or gain_text(s.get("gain")),
                s["verdict"],
                s.get("reason", ""),
            )
        )
    return table


def candidates_table(body: dict[str, Any]) -> Table:
    table = Table("round", "variable", "from -> to", "outcome", EFFECT, "pairs", "reason")
    for c in body.get("candidates", []):
        verdict = c.get("verdict")
        table.add_row(
            *_cells(
                c["round"],
                c["variable"],
                f"{level_text(c['from_level'])} -> {level_text(c['to_level'])}",
                c["outcome"] + (f" ({verdict})" if verdict and verdict != c["outcome"] else ""),
                c.get("effect") or gain_text(c.get("gain")),
                c.get("pairs", ""),
                c.get("reason", ""),
            )
        )
    return table


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
    return table


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
        out.print(f"  {body['url']}", markup=False)
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
        out.print(f"  {final['serve_command']}", markup=False)
    if final.get("spec"):
        out.print("re-run spec (save as a file, then `vlab submit FILE`):", markup=False)
        out.print(json.dumps(final["spec"], indent=2), markup=False)
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
) -> None:
    """Start a tuning campaign (POST /api/v1/campaigns); the service queues its runs."""
    base = _base(api)
    created = _call(
        "POST", f"{base}/api/v1/campaigns", ok=201, json=load_spec_file(file), timeout=300
    )
    console.print(f"campaign [bold]{created['id']}[/bold] ({created['status']}): {created['url']}")
    console.print(f"follow it with: vlab campaign show {created['id']}", markup=False)


@campaign_app.command("list")
@_one_line_errors
def campaign_list(
    api: ApiOpt = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="at most this many")] = 50,
) -> None:
    """List campaigns, newest first."""
    page = _call("GET", f"{_base(api)}/api/v1/campaigns", params={"limit": limit}, timeout=30)
    table = Table("id", "name", "status", "objective", "runs", "updated")
    for item in page.get("items", []):
        table.add_row(
            item["id"],
            item["name"],
            item["status"],
            item.get("objective", ""),
            str(item.get("run_count", 0)),
            str(item.get("updated_at", "")),
        )
    if page.get("items"):
        console.print(table)
        if page.get("total", 0) > len(page["items"]):
            console.print(f"{len(page['items'])} of {page['total']} shown", markup=False)
    else:
        console.print("no campaigns", markup=False)


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
) -> None:
    """A campaign: status, path, candidates, confirmation, final configuration."""
    url = f"{_base(api)}/api/v1/campaigns/{campaign_id}"
    body = _call("GET", url, timeout=30)
    last = ""
    while follow and body.get("status") in ("queued", "running"):
        line = progress_line(body)
        if line != last:  # a line when something moved, not one per look
            console.print(line, markup=False)
            last = line
        time.sleep(interval)
        body = _call("GET", url, timeout=30)
    if as_json:
        typer.echo(json.dumps({**body, **final_of(body)}, indent=2))
        return
    print_campaign(body, console)


@campaign_app.command("cancel")
@_one_line_errors
def campaign_cancel(
    campaign_id: Annotated[str, typer.Argument(help="the campaign's id")],
    api: ApiOpt = None,
) -> None:
    """Cancel a campaign: its queued runs end cancelled; started runs finish."""
    body = _call("POST", f"{_base(api)}/api/v1/campaigns/{campaign_id}/cancel", timeout=30)
    console.print(f"campaign {body['id']}: {body['status']}", markup=False)
