"""The ``vlab`` command line: serve the API, run the orchestrator, submit, watch, demo.

The commands that run the service are in :mod:`orchestrator.cli.serving`, what
the commands share in :mod:`orchestrator.cli.common`. ``vlab up`` runs everything in
the foreground (API + orchestrator, embedded Postgres and local Ray unless
``DATABASE_URL`` / ``RAY_ADDRESS`` are set).
Every other command is a client of the API (:mod:`orchestrator.cli.client`; ``VLAB_TOKEN``
sent as a bearer token), ``vlab token create|list|revoke`` too; only ``vlab token create
--database`` (the first token of a service to listen beyond loopback) writes to the
database. ``--json`` prints the API's answers; the exit codes are in
:mod:`orchestrator.cli.client`.

This module imports none of the service's machinery (the API's app, the database, the
dispatcher, the analyses: :mod:`orchestrator.cli.runtime`), so that ``vlab --help`` and
the API's clients start fast: the commands that start a service or open the database
import it when they run (``tests/orchestrator/cli/test_startup.py`` keeps it so).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from jobs.modelgen.generator import generate_model, model_digest
from orchestrator.cli import serving
from orchestrator.cli.campaign import campaign_app
from orchestrator.cli.client import (
    EXIT_UNAVAILABLE,
    Api,
    ApiError,
    json_on_timeout,
    print_json,
    say_unsuccessful,
)
from orchestrator.cli.common import ApiOpt, api_url, console, friendly, submit_spec
from orchestrator.cli.export import export_app
from orchestrator.cli.report import print_results, run_outcome
from orchestrator.cli.report import watch as watch_exp
from orchestrator.cli.resources import compare, experiments_app, runs_app, schedules_app
from orchestrator.cli.specfile import CliError, load_spec_file
from orchestrator.cli.tables import keep_words
from orchestrator.core.errors import EngineUnavailableError
from orchestrator.core.settings import get_settings

HELP = (
    "vlab: controlled vLLM experiments on Ray. `vlab up` runs the service (API, dashboard, "
    "orchestrator); the other commands call it (VLAB_TOKEN is sent as a bearer token)."
)
app = typer.Typer(help=HELP, no_args_is_help=True, add_completion=False)
models_app = typer.Typer(help="Generated Llama-shaped models (random weights, real compute).")
app.add_typer(models_app, name="model")
token_app = typer.Typer(
    help="API tokens. Roles: viewer (read), operator (submit, cancel, schedules, analyses), "
    "admin (tokens, cluster parity checks, path policy).",
    no_args_is_help=True,
)
app.add_typer(token_app, name="token")
app.add_typer(export_app, name="export")
app.add_typer(campaign_app, name="campaign")
app.add_typer(runs_app, name="runs", no_args_is_help=True)
app.add_typer(experiments_app, name="experiments", no_args_is_help=True)
app.add_typer(schedules_app, name="schedules", no_args_is_help=True)
warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")  # from the embedded Postgres

for command in (serving.up, serving.serve, serving.orchestrate, serving.migrate, serving.demo):
    app.command()(command)


JsonOpt = Annotated[bool, typer.Option("--json", help="print the API's JSON answer only")]
WaitTimeout = Annotated[
    float | None,
    typer.Option(
        "--wait-timeout",
        min=0,
        help="give up waiting after this many seconds: exit code 3 (runs keep going)",
    ),
]
Interval = Annotated[float, typer.Option(min=0.05, help="seconds between progress checks")]


def _finish(exp: dict[str, Any], json_out: bool, base: str) -> None:
    """The ended experiment: its JSON or its tables; exit 1 when a run failed."""
    if json_out:
        print_json(exp)
    else:
        print_results(exp, console, base)
    code = run_outcome(exp)
    if code:
        say_unsuccessful(exp)
        raise typer.Exit(code)


@app.command()
@friendly
def submit(
    spec: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSON or YAML spec")],
    api: ApiOpt = None,
    watch: Annotated[bool, typer.Option(help="show progress until the runs end")] = True,
    json_out: JsonOpt = False,
    wait_timeout: WaitTimeout = None,
    interval: Interval = 1.0,
) -> None:
    """Submit an experiment spec to the API; with --watch (the default) wait for its runs
    and exit 1 when one failed, 3 when --wait-timeout passed first."""
    base = api_url(api)
    progress = Console(stderr=True) if json_out else console
    created = submit_spec(base, load_spec_file(spec), progress)
    if created is None:
        raise typer.Exit(1)
    if not watch:
        if json_out:
            print_json(created)
        return
    with json_on_timeout(json_out):
        exp = watch_exp(
            base, created["id"], console=progress, interval_s=interval, timeout_s=wait_timeout
        )
    _finish(exp, json_out, base)


@app.command()
@friendly
def watch(
    experiment_id: str,
    api: ApiOpt = None,
    json_out: JsonOpt = False,
    wait_timeout: WaitTimeout = None,
    interval: Interval = 1.0,
) -> None:
    """Show an experiment's progress until its runs end, then its result table; exit 1
    when a run failed, 3 when --wait-timeout passed first."""
    base = api_url(api)
    progress = Console(stderr=True) if json_out else console
    with json_on_timeout(json_out):
        exp = watch_exp(
            base, experiment_id, console=progress, interval_s=interval, timeout_s=wait_timeout
        )
    _finish(exp, json_out, base)


app.command("compare")(compare)


@token_app.command("create")
@friendly
def token_create(
    name: Annotated[str, typer.Option("--name", help="who or what holds the token")],
    role: Annotated[str, typer.Option("--role", help="viewer, operator or admin")],
    expires_in_days: Annotated[
        float | None, typer.Option(help="days until it expires (default: never)")
    ] = None,
    database: Annotated[
        bool,
        typer.Option(
            "--database",
            help="write it straight into the service's database (DATABASE_URL / VLAB_HOME), "
            "without the API: for the first token of a service that is to listen beyond "
            "loopback, which refuses to start without one",
        ),
    ] = False,
    json_out: JsonOpt = False,
    api: ApiOpt = None,
) -> None:
    """Create an API token and print it (the only time it is shown). Through the API
    (POST /api/v1/tokens, an admin's VLAB_TOKEN; with no token yet the API is open on
    loopback, so the first one needs none)."""
    if expires_in_days is not None and not 1 / 24 <= expires_in_days <= 3650:
        raise CliError("--expires-in-days must be between 1/24 (an hour) and 3650")
    if database:
        # deferred: the service's wiring (its database, its authentication, SQLAlchemy),
        # which the commands calling the API never load
        from orchestrator.cli.runtime import create_token_in_database

        created = create_token_in_database(get_settings(), name, role, expires_in_days)
    else:
        body: dict[str, Any] = {"name": name, "role": role}
        if expires_in_days is not None:
            body["expires_in_days"] = expires_in_days
        try:
            created = Api(api).call("POST", "/api/v1/tokens", json_body=body)
        except ApiError as exc:
            if exc.exit_code == EXIT_UNAVAILABLE:  # a service that refused to start
                exc.lines.append(
                    "  the first token of a service that is to listen beyond loopback: "
                    "`vlab token create --database --name NAME --role admin`"
                )
            raise
    if json_out:
        print_json(created)
        return
    console.print(f"token {name!r} ({created['role']}) created; it is shown only this once:")
    typer.echo(created["token"])
    console.print(
        "send it as `Authorization: Bearer <token>`, sign in to the dashboard with it, "
        "or export VLAB_TOKEN=<token> for the other commands",
        markup=False,
    )


@token_app.command("list")
@friendly
def token_list(
    all_: Annotated[bool, typer.Option("--all", help="include revoked tokens")] = False,
    json_out: JsonOpt = False,
    api: ApiOpt = None,
) -> None:
    """List the API tokens, never their secrets (GET /api/v1/tokens; admin)."""
    rows = [t for t in Api(api).get("/api/v1/tokens") if all_ or not t.get("revoked_at")]
    if json_out:
        print_json(rows)
        return
    table = Table("name", "role", "key id", "created / by", "expires / last used", "state")
    for col in table.columns:
        col.overflow = "fold"
    table.columns[2].no_wrap = True  # the key id whole, on one line
    table.columns[3].min_width = table.columns[4].min_width = 16  # a time on one line

    def when(t: Any) -> str:
        return str(t)[:16].replace("T", " ") if t else "–"

    for t in rows:
        state = (
            "active"
            if t.get("active")
            else (f"revoked by {t.get('revoked_by')}" if t.get("revoked_at") else "expired")
        )
        table.add_row(
            t["name"],
            t["role"],
            t["key_id"],
            f"{when(t.get('created_at'))}\n{t.get('created_by') or '–'}",
            f"{when(t.get('expires_at'))}\n{when(t.get('last_used_at'))}",
            state,
        )
    none = "no tokens: the API is open on loopback addresses only"
    console.print(keep_words(table, console.width) if rows else none)


@token_app.command("revoke")
@friendly
def token_revoke(
    token: Annotated[str, typer.Argument(help="the token's name, key id or id")],
    json_out: JsonOpt = False,
    api: ApiOpt = None,
) -> None:
    """Revoke a token at once, its dashboard sessions too (DELETE /api/v1/tokens/{t})."""
    row = Api(api).call("DELETE", f"/api/v1/tokens/{token}")
    if json_out:
        print_json(row)
        return
    console.print(f"token {row['name']!r} revoked", markup=False)


@app.command("engine-args")
@friendly
def engine_args(
    refresh: Annotated[bool, typer.Option(help="ask the engine again")] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="print the catalogue as JSON only")
    ] = False,
) -> None:
    """List (and cache) the engine arguments the installed vLLM accepts. With --json:
    ``{"vllm_version", "count", "args": [{"name", "options", "type", "default",
    "choices", "is_bool_flag", "group", "help"}]}``, the arguments sorted by name."""
    # deferred: the engine's catalogue (numpy, through the engine's contract), which the
    # commands calling the API never load
    from orchestrator.experiments.engine_catalog import load_catalog

    try:
        cat = load_catalog(get_settings(), refresh=refresh)
    except EngineUnavailableError as exc:
        raise CliError(exc.detail) from None
    if json_out:
        print_json(engine_args_json(cat.vllm_version, cat.args))
        return
    console.print(f"vLLM {cat.vllm_version}: {len(cat.args)} engine arguments")


def engine_args_json(version: str, args: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The stable ``engine-args --json`` shape (docs/USAGE.md): one entry per argument, by
    its snake_case name, with the fields the launcher printed (absent ones ``null``)."""
    rows = [
        {
            "name": name,
            "options": list(info.get("options") or []),
            "type": info.get("type"),
            "default": info.get("default"),
            "choices": info.get("choices"),
            "is_bool_flag": bool(info.get("is_bool_flag")),
            "group": info.get("group"),
            "help": info.get("help"),
        }
        for name, info in sorted(args.items())
    ]
    return {"vllm_version": version, "count": len(rows), "args": rows}


@models_app.command("generate")
@friendly
def model_generate(
    name: Annotated[str, typer.Argument(help="tiny or small")],
    dest: Annotated[Path | None, typer.Option(help="folder (default <home>/models/NAME)")] = None,
    overwrite: bool = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="print the model folder as JSON only")
    ] = False,
) -> None:
    """Generate a Llama-shaped model folder (config + locally trained tokenizer). With
    --json: ``{"shape", "path", "digest"}`` (the full sha256 of its files)."""
    try:
        path = generate_model(dest or get_settings().models_dir / name, name, overwrite=overwrite)
    except FileExistsError:
        raise CliError(
            f"{dest or get_settings().models_dir / name} exists (--overwrite replaces it)"
        ) from None
    except ValueError as exc:  # an unknown shape
        raise CliError(str(exc)) from None
    digest = model_digest(path)
    if json_out:
        print_json({"shape": name, "path": str(path.resolve()), "digest": digest})
        return
    console.print(f"{path} (digest {digest[:16]})")


def main() -> None:  # pragma: no cover - console entry
    """Console entry (``vlab``)."""
    app()
