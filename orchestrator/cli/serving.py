"""The commands that run the service: ``up``, ``serve``, ``orchestrate``, ``migrate``
and ``demo``."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from orchestrator.cli import logsetup
from orchestrator.cli.common import console, friendly, submit_spec
from orchestrator.cli.report import print_results
from orchestrator.cli.report import watch as watch_exp
from orchestrator.cli.specfile import CliError, load_spec_file
from orchestrator.core.settings import Settings, get_settings

if TYPE_CHECKING:
    from orchestrator.cli.runtime import Runtime

Verbose = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="show every library's log lines and warnings here too (default: in the log file)",
    ),
]


def _setup_logging(verbose: bool = False, terminal_level: int = logging.INFO) -> None:
    """vlab's log lines on the terminal, everything else (Ray, Postgres, libraries'
    warnings) in ``<home>/logs/vlab.log`` (:mod:`orchestrator.cli.logsetup`); the command
    names the file once it runs (:func:`_say_log`), so that a refusal stays the only line."""
    logsetup.configure(get_settings().home, verbose=verbose, terminal_level=terminal_level)


def _say_log() -> None:
    """One line naming the log file (when :func:`_setup_logging` sent output there)."""
    path = logsetup.configured_log_path()
    if path is not None and not logsetup.is_verbose():
        console.print(
            f"log: {path} (Ray, Postgres and libraries; --verbose shows them here)",
            markup=False,
            soft_wrap=True,
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


def open_runtime(settings: Settings) -> Runtime:
    """The service's :class:`~orchestrator.cli.runtime.Runtime`, its database started
    (:func:`orchestrator.cli.runtime.open_runtime`)."""
    # deferred: the service's wiring (the API's app, the dispatcher: about 2 s), loaded
    # by the commands that start a service only
    from orchestrator.cli.runtime import open_runtime as open_service_runtime

    return open_service_runtime(settings)


def _auth_preflight(settings: Settings, rt: Runtime) -> None:
    """Refuse to serve on a non-loopback address without a token (one line, exit 2), or
    print the loud warning of ``VLAB_API__AUTH=none``; before Ray starts."""
    # deferred: the service's authentication, in the service's wiring (a service is starting)
    from orchestrator.cli.runtime import auth_warning

    warning = auth_warning(settings, rt)
    if warning:
        Console(stderr=True, soft_wrap=True).print(
            warning, style="bold red", markup=False, soft_wrap=True
        )


@friendly
def up(
    host: Annotated[str | None, typer.Option(help="API host")] = None,
    port: Annotated[int | None, typer.Option(help="API port (env VLAB_API__PORT)")] = None,
    verbose: Verbose = False,
) -> None:
    """Run the API and the orchestrator in the foreground until Ctrl-C."""
    _serve_foreground(host, port, verbose, orchestrator=True)


@friendly
def serve(
    host: Annotated[str | None, typer.Option(help="API host")] = None,
    port: Annotated[int | None, typer.Option(help="API port")] = None,
    verbose: Verbose = False,
) -> None:
    """Run the API server only (no orchestrator)."""
    _serve_foreground(host, port, verbose, orchestrator=False)


def _serve_foreground(
    host: str | None, port: int | None, verbose: bool, orchestrator: bool
) -> None:
    """The API in the foreground (with the orchestrator beside it for ``up``) until Ctrl-C
    or SIGTERM, which stop it cleanly (exit code 0: Postgres and a local Ray stopped)."""
    _setup_logging(verbose)
    settings = _bound(get_settings(), host, port)
    host, port = settings.api.host, settings.api.port
    _check_port_free(host, port)
    # SIGTERM and SIGINT stop what started, as in `vlab demo`; uvicorn handles both while
    # it serves, then restores this handler and raises the signal again: it ends here
    stop = _stop_on_sigterm()
    rt = open_runtime(settings)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            _auth_preflight(settings, rt)
            if orchestrator:
                rt.start_orchestrator()
                _stop_on_sigterm(stop)  # again: ray.init installs a SIGTERM handler
                _print_device_kind(rt)
            _say_log()
            _say_dashboard(settings)
            rt.serve_api_foreground(host, port)
    finally:
        stop.set()  # a signal while it stops interrupts nothing
        rt.stop()


def _say_dashboard(settings: Settings) -> None:
    """The one line saying where the service listens (uvicorn's own is in the log):
    ``VLAB_API__PUBLIC_URL`` when set, else the address it binds."""
    host, port = settings.api.host, settings.api.port
    base = (settings.api.public_url or "").rstrip("/") or (
        f"http://{f'[{host}]' if ':' in host else host}:{port}"
    )
    console.print(
        f"dashboard: {base}/ (API: {base}/api/v1, OpenAPI: {base}/docs)",
        markup=False,
        soft_wrap=True,
    )


@friendly
def orchestrate(
    metrics_port: Annotated[
        int | None,
        typer.Option(help="serve this process's GET /metrics on this port (dispatcher series)"),
    ] = None,
    metrics_host: Annotated[str, typer.Option(help="address of --metrics-port")] = "127.0.0.1",
    verbose: Verbose = False,
) -> None:
    """Run the orchestrator only: claim queued runs and execute them through Ray."""
    _setup_logging(verbose)
    if metrics_port is not None:
        _check_port_free(metrics_host, metrics_port, "--metrics-port")
    stop = _stop_on_sigterm()  # SIGTERM and Ctrl-C stop what started (exit code 0)
    rt = open_runtime(get_settings())
    try:
        with contextlib.suppress(KeyboardInterrupt):
            rt.start_orchestrator()
            # after Ray's start (ray.init installs a SIGTERM handler of its own that
            # aborts), before the line that says the orchestrator is up
            _stop_on_sigterm(stop)
            _print_device_kind(rt)
            _say_log()
            if metrics_port is not None:
                rt.start_metrics_thread(metrics_host, metrics_port)
                console.print(
                    f"metrics: http://{metrics_host}:{metrics_port}/metrics",
                    markup=False,
                    soft_wrap=True,
                )
            stop.wait()
    finally:
        stop.set()  # a signal while it stops interrupts nothing
        rt.stop()


@friendly
def migrate(verbose: Verbose = False) -> None:
    """Run ``alembic upgrade head`` on the configured database."""
    _setup_logging(verbose)
    rt = open_runtime(get_settings())
    console.print(f"database at head: {rt.url.split('@')[-1]}")
    rt.stop()


@friendly
def demo(
    spec: Annotated[Path, typer.Option(help="experiment spec")] = Path("examples/demo.json"),
    port: Annotated[
        int | None, typer.Option(help="API and dashboard port (env VLAB_API__PORT)")
    ] = None,
    exit_after: Annotated[
        bool,
        typer.Option(
            "--exit",
            envvar="VLAB_DEMO_EXIT",
            help="stop once the results are printed (tests, CI; env VLAB_DEMO_EXIT=1) "
            "instead of serving the dashboard until Ctrl-C",
        ),
    ] = False,
    verbose: Verbose = False,
) -> None:
    """Start everything, run the demo experiment (APC off vs on), print the results and
    the dashboard's pages, then keep the service running until Ctrl-C (``--exit``: stop)."""
    # deferred: the service's wiring (the API's app, the dispatcher: about 2 s) and the
    # engine's catalogue (numpy), which the API's client commands never load
    from orchestrator.cli.runtime import create_demo_token, revoke_demo_token
    from orchestrator.experiments.engine_catalog import load_catalog

    _setup_logging(verbose, logging.WARNING)
    settings = _bound(get_settings(), "127.0.0.1", port)
    port = settings.api.port
    spec_doc = load_spec_file(spec)
    _check_port_free("127.0.0.1", port)
    console.rule("vlab demo")
    _say_log()
    console.print("starting the database (embedded Postgres unless DATABASE_URL is set) ...")
    stop = _stop_on_sigterm()  # from here on, SIGTERM stops what started, as Ctrl-C does
    rt = open_runtime(settings)
    demo_token = None
    failed = False
    try:
        demo_token = create_demo_token(rt)
        console.print("reading the engine's argument list ...")
        cat = load_catalog(settings)
        console.print(f"  vLLM {cat.vllm_version}, {len(cat.args)} engine arguments")
        console.print("starting Ray and the orchestrator ...")
        rt.start_orchestrator()
        _stop_on_sigterm(stop)  # again: ray.init installs a SIGTERM handler that aborts
        _print_device_kind(rt)
        rt.start_api_thread("127.0.0.1", port)
        base = f"http://127.0.0.1:{port}"
        console.print(
            f"dashboard: {base}/ (API: {base}/api/v1, OpenAPI: {base}/docs)",
            markup=False,
            soft_wrap=True,
        )
        console.print(f"submitting {spec} ...")
        created = submit_spec(base, spec_doc)
        if created is None:
            raise typer.Exit(1)
        console.print(
            f"live progress: {base}/experiments/{created['id']}", markup=False, soft_wrap=True
        )
        exp = watch_exp(base, created["id"], console=console)
        print_results(exp, console, base)
        _print_dashboard(base, exp)
        failed = exp["status"] != "succeeded"
        if not exit_after:
            home = settings.home.resolve()
            console.print(
                f"dashboard: {base}/experiments/{exp['id']} (the service keeps running; "
                f"Ctrl-C to stop; data kept in {home})",
                markup=False,
                soft_wrap=True,
            )
            with contextlib.suppress(KeyboardInterrupt):
                stop.wait()
    finally:
        console.print("stopping ...")
        if demo_token is not None:
            revoke_demo_token(rt, demo_token)
        rt.stop()
    if failed:
        raise typer.Exit(1)


def _check_port_free(host: str, port: int, option: str = "--port or VLAB_API__PORT") -> None:
    """Refuse in one line (exit code 2), before anything starts, when ``host:port`` is
    taken (or cannot be bound); ``option``: what picks another port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise CliError(
                f"cannot serve on {host}:{port}: {exc.strerror or exc}; pick another port "
                f"with {option}"
            ) from None


def _stop_on_sigterm(stop: threading.Event | None = None) -> threading.Event:
    """An event SIGTERM sets (``stop``, or a new one); SIGTERM also interrupts the main
    thread as Ctrl-C does (a service still starting, or a demo watching its runs, stops
    the same way), once: a later signal while it stops is ignored. The service commands
    (``up``, ``serve``, ``orchestrate``, ``demo``) catch that ``KeyboardInterrupt``, stop
    what they started and exit 0, what a process manager expects of a SIGTERM."""
    stop = stop or threading.Event()

    def on_sigterm(*_: Any) -> None:
        if stop.is_set():
            return
        stop.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    # Ctrl-C the same way, also when SIGINT came ignored (a process started in the
    # background of a script inherits that, and Python then raises no KeyboardInterrupt)
    signal.signal(signal.SIGINT, on_sigterm)
    return stop


def _print_dashboard(base: str, exp: dict[str, Any]) -> None:
    """The dashboard's pages of the experiment: its ladder, a comparison of its variants
    (the first repeat of each) and the run history."""
    firsts: dict[str, str] = {}
    for run in exp.get("runs", []):
        firsts.setdefault(str(run["name"]), str(run["id"]))
    console.print("dashboard:")
    console.print(f"  experiment: {base}/experiments/{exp['id']}", markup=False, soft_wrap=True)
    if len(firsts) > 1:
        query = "&".join(f"run={run_id}" for run_id in firsts.values())
        console.print(f"  compare:    {base}/compare?{query}", markup=False, soft_wrap=True)
    console.print(f"  history:    {base}/", markup=False, soft_wrap=True)
