"""The commands that run the service: ``up``, ``serve``, ``orchestrate``, ``migrate``
and ``demo``."""

from __future__ import annotations

import logging
import os
import signal
import threading
from datetime import timedelta
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from orchestrator.cli.common import (
    cli_actor,
    console,
    friendly,
    open_runtime,
    submit_spec,
)
from orchestrator.cli.report import print_results
from orchestrator.cli.report import watch as watch_exp
from orchestrator.cli.runtime import Runtime
from orchestrator.cli.specfile import CliError, load_spec_file
from orchestrator.core import auth
from orchestrator.core.auth import AuthSetupError, startup_check
from orchestrator.core.db import unit_of_work
from orchestrator.core.repositories import TokenRepository, utcnow
from orchestrator.core.settings import Settings, get_settings
from orchestrator.experiments.engine_catalog import load_catalog


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


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


@friendly
def up(
    host: Annotated[str | None, typer.Option(help="API host")] = None,
    port: Annotated[int | None, typer.Option(help="API port (env VLAB_API__PORT)")] = None,
) -> None:
    """Run the API and the orchestrator in the foreground until Ctrl-C."""
    _setup_logging()
    settings = _bound(get_settings(), host, port)
    rt = open_runtime(settings)
    try:
        _auth_preflight(settings, rt)
        rt.start_orchestrator()
        _print_device_kind(rt)
        rt.serve_api_foreground(settings.api.host, settings.api.port)
    finally:
        rt.stop()


@friendly
def serve(
    host: Annotated[str | None, typer.Option(help="API host")] = None,
    port: Annotated[int | None, typer.Option(help="API port")] = None,
) -> None:
    """Run the API server only (no orchestrator)."""
    _setup_logging()
    settings = _bound(get_settings(), host, port)
    rt = open_runtime(settings)
    try:
        _auth_preflight(settings, rt)
        rt.serve_api_foreground(settings.api.host, settings.api.port)
    finally:
        rt.stop()


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
    rt = open_runtime(get_settings())
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


@friendly
def migrate() -> None:
    """Run ``alembic upgrade head`` on the configured database."""
    _setup_logging()
    rt = open_runtime(get_settings())
    console.print(f"database at head: {rt.url.split('@')[-1]}")
    rt.stop()


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
    rt = open_runtime(settings)
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
            created_by=cli_actor(),
            expires_at=utcnow() + timedelta(days=1),
        )
        token_id = token.id
    os.environ[auth.TOKEN_ENV] = secret
    return token_id


def _revoke_demo_token(rt: Runtime, token_id: str) -> None:
    os.environ.pop(auth.TOKEN_ENV, None)
    with unit_of_work(rt.sessions) as session:
        auth.revoke_token(session, token_id, by="demo")
