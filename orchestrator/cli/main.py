"""The ``vlab`` command line: serve the API, run the orchestrator, submit, watch, demo.

The commands that run the service are in :mod:`orchestrator.cli.serving`, what
the commands share in :mod:`orchestrator.cli.common`. ``vlab up`` runs everything in
the foreground (API + orchestrator, embedded Postgres and local Ray unless
``DATABASE_URL`` / ``RAY_ADDRESS`` are set).
``vlab token create|list|revoke`` manage API tokens (straight in the database);
the commands that call the API send ``VLAB_TOKEN`` as a bearer token when it is set.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from jobs.modelgen.generator import generate_model, model_digest
from orchestrator.cli import serving
from orchestrator.cli.campaign import campaign_app
from orchestrator.cli.common import (
    ApiOpt,
    api_url,
    cli_actor,
    console,
    friendly,
    open_runtime,
    submit_spec,
)
from orchestrator.cli.export import export_app
from orchestrator.cli.report import print_results
from orchestrator.cli.report import watch as watch_exp
from orchestrator.cli.specfile import CliError, load_spec_file
from orchestrator.core import auth
from orchestrator.core.auth import token_usable
from orchestrator.core.db import unit_of_work
from orchestrator.core.errors import TokenError
from orchestrator.core.repositories import AuditRepository, TokenRepository, utcnow
from orchestrator.core.settings import get_settings
from orchestrator.experiments.engine_catalog import load_catalog

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
warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")  # from the embedded Postgres

for command in (serving.up, serving.serve, serving.orchestrate, serving.migrate, serving.demo):
    app.command()(command)


@app.command()
@friendly
def submit(
    spec: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSON or YAML spec")],
    api: ApiOpt = None,
    watch: Annotated[bool, typer.Option(help="show progress until the runs end")] = True,
) -> None:
    """Submit an experiment spec to the API."""
    base = api_url(api)
    created = submit_spec(base, load_spec_file(spec))
    if created is None:
        raise typer.Exit(1)
    if watch:
        print_results(watch_exp(base, created["id"], console=console), console, base)


@app.command()
@friendly
def watch(experiment_id: str, api: ApiOpt = None) -> None:
    """Show an experiment's progress until its runs end, then its result table."""
    print_results(watch_exp(api_url(api), experiment_id, console=console), console, api_url(api))


@token_app.command("create")
@friendly
def token_create(
    name: Annotated[str, typer.Option("--name", help="who or what holds the token")],
    role: Annotated[str, typer.Option("--role", help="viewer, operator or admin")],
    expires_in_days: Annotated[
        float | None, typer.Option(help="days until it expires (default: never)")
    ] = None,
) -> None:
    """Create an API token and print it (the only time it is shown)."""
    if expires_in_days is not None and not 1 / 24 <= expires_in_days <= 3650:
        raise CliError("--expires-in-days must be between 1/24 (an hour) and 3650")
    rt = open_runtime(get_settings())
    try:
        actor = cli_actor()
        with unit_of_work(rt.sessions) as session:
            token, secret = auth.create_token(
                session,
                name=name,
                role=role,
                created_by=actor,
                expires_at=utcnow() + timedelta(days=expires_in_days) if expires_in_days else None,
            )
            AuditRepository(session).add(actor=actor, action="token.create", target=name)
            role_name = token.role
    except TokenError as exc:
        raise CliError(exc.detail) from None
    finally:
        rt.stop()
    console.print(f"token {name!r} ({role_name}) created; it is shown only this once:")
    typer.echo(secret)
    console.print(
        "send it as `Authorization: Bearer <token>`, sign in to the dashboard with it, "
        "or export VLAB_TOKEN=<token> for `vlab submit`",
        markup=False,
    )


@token_app.command("list")
@friendly
def token_list(
    all_: Annotated[bool, typer.Option("--all", help="include revoked tokens")] = False,
) -> None:
    """List the API tokens (never their secrets)."""
    rt = open_runtime(get_settings())
    try:
        with unit_of_work(rt.sessions) as session:
            rows = TokenRepository(session).all(include_revoked=all_)
    finally:
        rt.stop()
    now = utcnow()
    table = Table("name", "role", "key id", "created", "by", "expires", "last used", "state")

    def when(t: Any) -> str:
        return t.strftime("%Y-%m-%d %H:%M UTC") if t else "–"

    for t in rows:
        state = (
            "active"
            if token_usable(t, now)
            else (f"revoked by {t.revoked_by}" if t.revoked_at else "expired")
        )
        table.add_row(
            t.name,
            t.role,
            t.key_id,
            when(t.created_at),
            t.created_by or "–",
            when(t.expires_at),
            when(t.last_used_at),
            state,
        )
    console.print(table if rows else "no tokens: the API is open on loopback addresses only")


@token_app.command("revoke")
@friendly
def token_revoke(
    token: Annotated[str, typer.Argument(help="the token's name, key id or id")],
) -> None:
    """Revoke a token at once (its dashboard sessions end too)."""
    rt = open_runtime(get_settings())
    try:
        actor = cli_actor()
        with unit_of_work(rt.sessions) as session:
            row = auth.revoke_token(session, token, by=actor)
            AuditRepository(session).add(actor=actor, action="token.revoke", target=row.name)
            name = row.name
    except TokenError as exc:
        raise CliError(exc.detail) from None
    finally:
        rt.stop()
    console.print(f"token {name!r} revoked")


@app.command("engine-args")
@friendly
def engine_args(
    refresh: Annotated[bool, typer.Option(help="ask the engine again")] = False,
) -> None:
    """List (and cache) the engine arguments the installed vLLM accepts."""
    cat = load_catalog(get_settings(), refresh=refresh)
    console.print(f"vLLM {cat.vllm_version}: {len(cat.args)} engine arguments")


@models_app.command("generate")
@friendly
def model_generate(
    name: Annotated[str, typer.Argument(help="tiny or small")],
    dest: Annotated[Path | None, typer.Option(help="folder (default <home>/models/NAME)")] = None,
    overwrite: bool = False,
) -> None:
    """Generate a Llama-shaped model folder (config + locally trained tokenizer)."""
    path = generate_model(dest or get_settings().models_dir / name, name, overwrite=overwrite)
    console.print(f"{path} (digest {model_digest(path)[:16]})")


def main() -> None:  # pragma: no cover - console entry
    """Console entry (``vlab``)."""
    app()
