"""The ``vlab`` command line: serve the API, run the orchestrator, submit, watch, demo.

``vlab up`` runs everything in the foreground (API + orchestrator, embedded
Postgres and local Ray unless ``DATABASE_URL`` / ``RAY_ADDRESS`` are set).
``vlab token create|list|revoke`` manage API tokens (straight in the database);
the commands that call the API send ``VLAB_TOKEN`` as a bearer token when it is set.
"""

from __future__ import annotations

import functools
import getpass
import json
import logging
import os
import re
import signal
import sys
import threading
import types
import typing
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, OperationalError

from jobs.modelgen.generator import generate_model, model_digest
from orchestrator.cli.campaign import campaign_app
from orchestrator.cli.export import export_app
from orchestrator.cli.report import ReportError, print_results
from orchestrator.cli.report import watch as watch_exp
from orchestrator.cli.runtime import Runtime
from orchestrator.cli.specfile import CliError, load_spec_file
from orchestrator.core import auth
from orchestrator.core.auth import AuthSetupError, client_auth_headers, startup_check, token_usable
from orchestrator.core.db import unit_of_work
from orchestrator.core.errors import RayClusterError, TokenError
from orchestrator.core.repositories import AuditRepository, TokenRepository, utcnow
from orchestrator.core.settings import Settings, get_settings
from orchestrator.experiments.engine_catalog import load_catalog

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False)
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
# Not a terminal (logs, CI): wide enough for the result table, no line wrapping of URLs.
console = Console() if sys.stdout.isatty() else Console(width=200, soft_wrap=True)
warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")  # from the embedded Postgres

ApiOpt = Annotated[str | None, typer.Option("--api", help="API base URL (default from settings)")]


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _api(api: str | None) -> str:
    return (api or get_settings().api_base_url()).rstrip("/")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _takes_json(path: list[str]) -> bool:
    """Whether pydantic-settings decodes the setting at ``path`` (field names) as JSON.

    Only complex fields (a dict, a list, a nested model given whole) are decoded; walking
    the :class:`Settings` fields keeps a plain setting beside it (``VLAB_ENGINE__PYTHON``,
    a path) from being taken for the value that failed.
    """
    model: Any = Settings
    annotation: Any = None
    for name in path:
        fields = getattr(model, "model_fields", None)
        if not fields or name not in fields:
            return False
        annotation = fields[name].annotation
        model = annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else annotation
        origin = typing.get_origin(annotation)
    if origin in (dict, list, set, tuple, frozenset):
        return True
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def settings_problem(exc: ValidationError | SettingsError) -> str:
    """One line naming the environment variable of a setting that failed validation.

    A pydantic ``loc`` ``("engine", "python_by_node")`` is ``VLAB_ENGINE__PYTHON_BY_NODE``;
    pydantic-settings' :class:`SettingsError` (a value that is not JSON where JSON is
    needed) names only the top-level field: the variable under it whose value is not
    JSON is named when there is exactly one.
    """
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
            name = "VLAB_" + "__".join(loc).upper() if loc else "VLAB_*"
            parts.append(f"invalid setting {name}: {_one_line(str(err.get('msg', '')))}")
        return "; ".join(parts) or _one_line(str(exc))
    text = _one_line(str(exc))
    match = re.search(r'field "([^"]+)"', text)
    name = "VLAB_*"
    if match:
        prefix = "VLAB_" + match.group(1).upper()
        found = [
            k for k in os.environ if k.upper() == prefix or k.upper().startswith(prefix + "__")
        ]
        bad = []
        for key in found:
            if not _takes_json(key[len("VLAB_") :].lower().split("__")):
                continue  # a plain str/int/path setting is never decoded as JSON
            try:
                json.loads(os.environ[key])
            except ValueError:
                bad.append(key)
        name = bad[0].upper() if len(bad) == 1 else prefix + ("__*" if found else "")
    reason = text
    if exc.__cause__ is not None:
        reason = f"not valid JSON ({_one_line(str(exc.__cause__))})"
    return f"invalid setting {name}: {reason}"


def _is_settings_error(exc: BaseException) -> bool:
    return isinstance(exc, SettingsError) or (
        isinstance(exc, ValidationError) and exc.title == Settings.__name__
    )


def friendly(func: Callable[..., None]) -> Callable[..., None]:
    """Turn user-facing failures into one line on stderr and exit code 2 (no traceback)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            func(*args, **kwargs)
        except (
            CliError,
            ReportError,
            TimeoutError,
            RayClusterError,
            ValidationError,
            SettingsError,
        ) as exc:
            if isinstance(exc, ValidationError | SettingsError):
                if not _is_settings_error(exc):
                    raise
                said = settings_problem(exc)
            else:
                said = str(exc)
            # one line, however narrow the terminal (or none): no hard wrapping
            Console(stderr=True, soft_wrap=True).print(
                f"[red]error:[/red] {escape(said)}", markup=True
            )
            raise typer.Exit(2) from None

    return wrapper


def _http(method: str, url: str, **kw: Any) -> httpx.Response:
    kw["headers"] = {**client_auth_headers(), **(kw.get("headers") or {})}
    try:
        return httpx.request(method, url, **kw)
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the API at {url}: {exc} (is `vlab up` running?)") from exc


def _print_problem(resp: httpx.Response) -> None:
    try:
        body = resp.json()
    except ValueError:
        console.print(f"[red]HTTP {resp.status_code}[/red]: {resp.text}")
        return
    console.print(
        f"[red]{body.get('title', 'error')}[/red] ({resp.status_code}): {body.get('detail')}"
    )
    for err in body.get("errors", []):
        console.print(f"  - {'.'.join(map(str, err['loc']))}: {err['msg']}")


def submit_spec(api: str, spec: dict[str, Any]) -> dict[str, Any] | None:
    resp = _http("POST", f"{api}/api/v1/experiments", json=spec, timeout=300)
    if resp.status_code != 201:
        _print_problem(resp)
        if resp.status_code == 401:
            console.print("  set VLAB_TOKEN to an operator token (`vlab token create`)")
        return None
    created: dict[str, Any] = resp.json()
    console.print(f"experiment [bold]{created['id']}[/bold]: {created['url']}")
    for run in created["runs"]:
        console.print(f"  run {run['name']} (repeat {run['repeat_index']}): {run['url']}")
    estimate = created.get("capacity_estimate")
    if isinstance(estimate, dict) and estimate.get("experiment_s_max") is not None:
        console.print(
            f"capacity search: at most {estimate['experiment_s_max'] / 60:.0f} min of load in "
            f"all ({estimate.get('note', '')})",
            markup=False,
        )
    return created


@app.command()
@friendly
def submit(
    spec: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSON or YAML spec")],
    api: ApiOpt = None,
    watch: Annotated[bool, typer.Option(help="show progress until the runs end")] = True,
) -> None:
    """Submit an experiment spec to the API."""
    base = _api(api)
    created = submit_spec(base, load_spec_file(spec))
    if created is None:
        raise typer.Exit(1)
    if watch:
        print_results(watch_exp(base, created["id"], console=console), console, base)


@app.command()
@friendly
def watch(experiment_id: str, api: ApiOpt = None) -> None:
    """Show an experiment's progress until its runs end, then its result table."""
    print_results(watch_exp(_api(api), experiment_id, console=console), console, _api(api))


def _safe_url(url: str) -> str:
    """The database URL without its password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url.split("@")[-1]


def _runtime(settings: Settings) -> Runtime:
    rt = Runtime(settings)
    try:
        rt.start_database()
    except OperationalError as exc:
        rt.stop()
        reason = str(exc.orig) if exc.orig is not None else str(exc)
        first = (reason.strip().splitlines() or [type(exc).__name__])[0]
        url = settings.database_url or rt.url or "(embedded)"
        raise CliError(
            f"cannot reach the database at {_safe_url(url)}: {_one_line(first)}"
        ) from None
    return rt


def _print_device_kind(rt: Runtime) -> None:
    """One start-up line: the device kind runs reserve, and whether it was detected."""
    if rt.device_kind is None:
        return
    kind, source = rt.device_kind
    how = (
        "detected from the Ray cluster"
        if source == "detected"
        else "set by VLAB_ORCHESTRATOR__DEVICE_RESOURCE"
    )
    what = "GPUs (each run holds its GPUs through Ray)" if kind == "GPU" else "CPU cores"
    console.print(f"device kind: {kind}, {how}: a device is one of the cluster's {what}")


def _bound(settings: Settings, host: str | None, port: int | None) -> Settings:
    """``settings`` with the API's host and port overridden (the app checks the host)."""
    changes = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    if not changes:
        return settings
    return settings.model_copy(update={"api": settings.api.model_copy(update=changes)})


def _auth_preflight(settings: Settings, rt: Runtime) -> None:
    """Refuse to serve on a non-loopback address without a token (one line, exit 2), or
    print the loud warning of ``VLAB_API__AUTH=none``; before Ray starts."""
    try:
        warning = startup_check(settings, rt.sessions)
    except AuthSetupError as exc:
        raise CliError(str(exc)) from None
    if warning:
        Console(stderr=True, soft_wrap=True).print(warning, style="bold red", markup=False)


@app.command()
@friendly
def up(
    host: Annotated[str | None, typer.Option(help="API host")] = None,
    port: Annotated[int | None, typer.Option(help="API port (env VLAB_API__PORT)")] = None,
) -> None:
    """Run the API and the orchestrator in the foreground until Ctrl-C."""
    _setup_logging()
    settings = _bound(get_settings(), host, port)
    rt = _runtime(settings)
    try:
        _auth_preflight(settings, rt)
        rt.start_orchestrator()
        _print_device_kind(rt)
        rt.serve_api_foreground(settings.api.host, settings.api.port)
    finally:
        rt.stop()


@app.command()
@friendly
def serve(
    host: Annotated[str | None, typer.Option(help="API host")] = None,
    port: Annotated[int | None, typer.Option(help="API port")] = None,
) -> None:
    """Run the API server only (no orchestrator)."""
    _setup_logging()
    settings = _bound(get_settings(), host, port)
    rt = _runtime(settings)
    try:
        _auth_preflight(settings, rt)
        rt.serve_api_foreground(settings.api.host, settings.api.port)
    finally:
        rt.stop()


def _cli_actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # noqa: BLE001 - no user name (containers): still say where it came from
        return "cli"


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
    rt = _runtime(get_settings())
    try:
        actor = _cli_actor()
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
    rt = _runtime(get_settings())
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
    rt = _runtime(get_settings())
    try:
        actor = _cli_actor()
        with unit_of_work(rt.sessions) as session:
            row = auth.revoke_token(session, token, by=actor)
            AuditRepository(session).add(actor=actor, action="token.revoke", target=row.name)
            name = row.name
    except TokenError as exc:
        raise CliError(exc.detail) from None
    finally:
        rt.stop()
    console.print(f"token {name!r} revoked")


@app.command()
@friendly
def orchestrate(
    metrics_port: Annotated[
        int | None,
        typer.Option(help="serve this process's GET /metrics on this port (dispatcher series)"),
    ] = None,
    metrics_host: Annotated[str, typer.Option(help="address of --metrics-port")] = "127.0.0.1",
) -> None:
    """Run the orchestrator only: claim queued runs and execute them through Ray."""
    _setup_logging()
    rt = _runtime(get_settings())
    rt.start_orchestrator()
    _print_device_kind(rt)
    if metrics_port is not None:
        rt.start_metrics_thread(metrics_host, metrics_port)
        console.print(f"metrics: http://{metrics_host}:{metrics_port}/metrics", markup=False)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        rt.stop()


@app.command()
@friendly
def migrate() -> None:
    """Run ``alembic upgrade head`` on the configured database."""
    _setup_logging()
    rt = _runtime(get_settings())
    console.print(f"database at head: {rt.url.split('@')[-1]}")
    rt.stop()


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


@app.command()
@friendly
def demo(
    spec: Annotated[Path, typer.Option(help="experiment spec")] = Path("examples/demo.json"),
    port: Annotated[int, typer.Option(help="API port for the demo")] = 8000,
) -> None:
    """Start everything, run the demo experiment (APC off vs on), print the results."""
    _setup_logging()
    logging.getLogger().setLevel(logging.WARNING)
    settings = _bound(get_settings(), "127.0.0.1", port)
    spec_doc = load_spec_file(spec)
    console.rule("vlab demo")
    console.print("starting the database (embedded Postgres unless DATABASE_URL is set) ...")
    rt = _runtime(settings)
    demo_token = None
    try:
        demo_token = _demo_token(rt)
        console.print("reading the engine's argument list ...")
        cat = load_catalog(settings)
        console.print(f"  vLLM {cat.vllm_version}, {len(cat.args)} engine arguments")
        console.print("starting Ray and the orchestrator ...")
        rt.start_orchestrator()
        _print_device_kind(rt)
        rt.start_api_thread("127.0.0.1", port)
        api = f"http://127.0.0.1:{port}"
        console.print(f"API on {api} (OpenAPI: {api}/docs)")
        console.print(f"submitting {spec} ...")
        created = submit_spec(api, spec_doc)
        if created is None:
            raise typer.Exit(1)
        exp = watch_exp(api, created["id"], console=console)
        print_results(exp, console, api)
        if exp["status"] != "succeeded":
            raise typer.Exit(1)
    finally:
        console.print("stopping ...")
        if demo_token is not None:
            _revoke_demo_token(rt, demo_token)
        rt.stop()


def _demo_token(rt: Runtime) -> str | None:
    """When tokens exist and ``VLAB_TOKEN`` is unset: a one-day operator token for the
    demo's own API calls (revoked when it ends); returns its id, or None."""
    if os.environ.get(auth.TOKEN_ENV):
        return None
    with unit_of_work(rt.sessions) as session:
        if not TokenRepository(session).any_active(utcnow()):
            return None
        token, secret = auth.create_token(
            session,
            name=f"demo-{os.getpid()}-{int(utcnow().timestamp())}",
            role="operator",
            created_by=_cli_actor(),
            expires_at=utcnow() + timedelta(days=1),
        )
        token_id = token.id
    os.environ[auth.TOKEN_ENV] = secret
    return token_id


def _revoke_demo_token(rt: Runtime, token_id: str) -> None:
    os.environ.pop(auth.TOKEN_ENV, None)
    with unit_of_work(rt.sessions) as session:
        auth.revoke_token(session, token_id, by="demo")


def main() -> None:  # pragma: no cover - console entry
    """Console entry (``vlab``)."""
    app()
