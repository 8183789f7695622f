"""The ``vlab`` command line: serve the API, run the orchestrator, submit, watch, demo.

``vlab up`` runs everything in the foreground (API + orchestrator, embedded
Postgres and local Ray unless ``DATABASE_URL`` / ``RAY_ADDRESS`` are set).
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml
from rich.console import Console

from orchestrator.settings import Settings, get_settings

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False)
models_app = typer.Typer(help="Generated Llama-shaped models (random weights, real compute).")
app.add_typer(models_app, name="model")
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


class CliError(Exception):
    """A user-facing failure: printed as one line, exit code 2."""


def load_spec_file(path: Path) -> dict[str, Any]:
    """Read a spec from JSON or YAML (by extension; YAML is a superset of JSON).

    Raises :class:`CliError` with the parser's message and position.
    """
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise CliError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from exc
    except yaml.YAMLError as exc:
        raise CliError(f"{path}: invalid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(data, dict):
        raise CliError(f"{path}: the spec must be an object")
    _inline_replay_files(data, path.parent)
    return data


def _inline_replay_files(spec: dict[str, Any], base: Path) -> None:
    """Replace each ``workload.replay_file`` (JSONL, relative to the spec) with its requests.

    Looks at ``baseline.workload`` and every variant's ``changes`` value for
    ``workload.replay_file``. Raises :class:`CliError` naming the file and
    every bad line (:func:`jobs.replay.load_jsonl`); nothing is submitted then.
    """
    from jobs.replay import ReplayFileError, load_jsonl

    def load(name: Any) -> list[dict[str, Any]]:
        if not isinstance(name, str):
            raise CliError("workload.replay_file must be a path")
        file = (base / name).expanduser()
        try:
            return load_jsonl(file)
        except ReplayFileError as exc:
            raise CliError(f"{file}: {exc}") from exc
        except OSError as exc:
            raise CliError(f"{file}: cannot read the replay file: {exc.strerror}") from exc

    baseline = spec.get("baseline")
    workload = baseline.get("workload") if isinstance(baseline, dict) else None
    if isinstance(workload, dict) and "replay_file" in workload:
        if "replay" in workload:
            raise CliError("workload: give 'replay' or 'replay_file', not both")
        workload["replay"] = load(workload.pop("replay_file"))
    for variant in spec.get("variants") or []:
        changes = variant.get("changes") if isinstance(variant, dict) else None
        if isinstance(changes, dict) and "workload.replay_file" in changes:
            if "workload.replay" in changes:
                raise CliError(
                    "changes: give 'workload.replay' or 'workload.replay_file', not both"
                )
            changes["workload.replay"] = load(changes.pop("workload.replay_file"))


def friendly(func: Callable[..., None]) -> Callable[..., None]:
    """Turn user-facing failures into one line on stderr and exit code 2 (no traceback)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        from orchestrator.report import ReportError

        try:
            func(*args, **kwargs)
        except (CliError, ReportError, TimeoutError) as exc:
            # one line, however narrow the terminal (or none): no hard wrapping
            Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {exc}", markup=True)
            raise typer.Exit(2) from None

    return wrapper


def _http(method: str, url: str, **kw: Any) -> httpx.Response:
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
        return None
    created: dict[str, Any] = resp.json()
    console.print(f"experiment [bold]{created['id']}[/bold]: {created['url']}")
    for run in created["runs"]:
        console.print(f"  run {run['name']} (repeat {run['repeat_index']}): {run['url']}")
    return created


@app.command()
@friendly
def submit(
    spec: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSON or YAML spec")],
    api: ApiOpt = None,
    watch: Annotated[bool, typer.Option(help="show progress until the runs end")] = True,
) -> None:
    """Submit an experiment spec to the API."""
    from orchestrator.report import print_results
    from orchestrator.report import watch as watch_exp

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
    from orchestrator.report import print_results
    from orchestrator.report import watch as watch_exp

    print_results(watch_exp(_api(api), experiment_id, console=console), console, _api(api))


def _runtime(settings: Settings):  # type: ignore[no-untyped-def]
    from orchestrator.runtime import Runtime

    rt = Runtime(settings)
    rt.start_database()
    return rt


def _print_device_kind(rt) -> None:  # type: ignore[no-untyped-def]
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


@app.command()
def up(
    host: Annotated[str | None, typer.Option(help="API host")] = None,
    port: Annotated[int | None, typer.Option(help="API port (env VLAB_API__PORT)")] = None,
) -> None:
    """Run the API and the orchestrator in the foreground until Ctrl-C."""
    _setup_logging()
    settings = get_settings()
    rt = _runtime(settings)
    rt.start_orchestrator()
    _print_device_kind(rt)
    try:
        rt.serve_api_foreground(host or settings.api.host, port or settings.api.port)
    finally:
        rt.stop()


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="API host")] = None,
    port: Annotated[int | None, typer.Option(help="API port")] = None,
) -> None:
    """Run the API server only (no orchestrator)."""
    _setup_logging()
    settings = get_settings()
    rt = _runtime(settings)
    try:
        rt.serve_api_foreground(host or settings.api.host, port or settings.api.port)
    finally:
        rt.stop()


@app.command()
def orchestrate() -> None:
    """Run the orchestrator only: claim queued runs and execute them through Ray."""
    _setup_logging()
    rt = _runtime(get_settings())
    rt.start_orchestrator()
    _print_device_kind(rt)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        rt.stop()


@app.command()
def migrate() -> None:
    """Run ``alembic upgrade head`` on the configured database."""
    _setup_logging()
    rt = _runtime(get_settings())
    console.print(f"database at head: {rt.url.split('@')[-1]}")
    rt.stop()


@app.command("engine-args")
def engine_args(
    refresh: Annotated[bool, typer.Option(help="ask the engine again")] = False,
) -> None:
    """List (and cache) the engine arguments the installed vLLM accepts."""
    from orchestrator.engine_catalog import load_catalog

    cat = load_catalog(get_settings(), refresh=refresh)
    console.print(f"vLLM {cat.vllm_version}: {len(cat.args)} engine arguments")


@models_app.command("generate")
def model_generate(
    name: Annotated[str, typer.Argument(help="tiny or small")],
    dest: Annotated[Path | None, typer.Option(help="folder (default <home>/models/NAME)")] = None,
    overwrite: bool = False,
) -> None:
    """Generate a Llama-shaped model folder (config + locally trained tokenizer)."""
    from jobs.modelgen import generate_model, model_digest

    path = generate_model(dest or get_settings().models_dir / name, name, overwrite=overwrite)
    console.print(f"{path} (digest {model_digest(path)[:16]})")


@app.command()
@friendly
def demo(
    spec: Annotated[Path, typer.Option(help="experiment spec")] = Path("examples/demo.json"),
    port: Annotated[int, typer.Option(help="API port for the demo")] = 8000,
) -> None:
    """Start everything, run the demo experiment (APC off vs on), print the results."""
    from orchestrator.engine_catalog import load_catalog
    from orchestrator.report import print_results
    from orchestrator.report import watch as watch_exp

    _setup_logging()
    logging.getLogger().setLevel(logging.WARNING)
    settings = get_settings()
    spec_doc = load_spec_file(spec)
    console.rule("vlab demo")
    console.print("starting the database (embedded Postgres unless DATABASE_URL is set) ...")
    rt = _runtime(settings)
    try:
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
        rt.stop()


def main() -> None:  # pragma: no cover - console entry
    """Console entry (``vlab``)."""
    app()
