"""What the ``vlab`` commands share: the console, one-line errors, calls to the API."""

from __future__ import annotations

import functools
import json
import os
import re
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

import httpx
import typer
from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError
from rich.console import Console
from rich.markup import escape

from orchestrator.cli.client import (
    EXIT_TIMEOUT,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    ApiError,
    WaitTimeout,
    check_api_url,
    client_auth_headers,
    make_console,
    page_url,
    problem_lines,
    repeat_number,
)
from orchestrator.cli.report import ReportError
from orchestrator.cli.specfile import CliError
from orchestrator.core.errors import RayClusterError
from orchestrator.core.settings import Settings, get_settings

# At most 100 columns, terminal or not (logs, CI): the tables wrap their cells to fit.
console = make_console()

ApiOpt = Annotated[
    str | None,
    typer.Option("--api", help="API base URL (default from settings)", callback=check_api_url),
]


def api_url(api: str | None) -> str:
    return (api or get_settings().api_base_url()).rstrip("/")


def one_line(text: str) -> str:
    return " ".join(text.split())


def takes_json(path: list[str]) -> bool:
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
            parts.append(f"invalid setting {name}: {one_line(str(err.get('msg', '')))}")
        return "; ".join(parts) or one_line(str(exc))
    text = one_line(str(exc))
    match = re.search(r'field "([^"]+)"', text)
    name = "VLAB_*"
    if match:
        prefix = "VLAB_" + match.group(1).upper()
        found = [
            k for k in os.environ if k.upper() == prefix or k.upper().startswith(prefix + "__")
        ]
        bad = []
        for key in found:
            if not takes_json(key[len("VLAB_") :].lower().split("__")):
                continue  # a plain str/int/path setting is never decoded as JSON
            try:
                json.loads(os.environ[key])
            except ValueError:
                bad.append(key)
        name = bad[0].upper() if len(bad) == 1 else prefix + ("__*" if found else "")
    reason = text
    if exc.__cause__ is not None:
        reason = f"not valid JSON ({one_line(str(exc.__cause__))})"
    return f"invalid setting {name}: {reason}"


def is_settings_error(exc: BaseException) -> bool:
    return isinstance(exc, SettingsError) or (
        isinstance(exc, ValidationError) and exc.title == Settings.__name__
    )


def friendly(func: Callable[..., None]) -> Callable[..., None]:
    """Turn user-facing failures into one line on stderr (no traceback), each said once:
    exit code 2 (a bad argument, file or setting; the service refused the request; any
    other timeout), 3 (``--wait-timeout``: :class:`WaitTimeout`), or the
    :class:`ApiError`'s own (4: the service unreachable or failing)."""

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
                if not is_settings_error(exc):
                    raise
                said = settings_problem(exc)
            else:
                said = str(exc)
            lines = exc.lines if isinstance(exc, ApiError) else [one_line(said)]
            # one line each, however narrow the terminal (or none): no hard wrapping
            err = Console(stderr=True, soft_wrap=True)
            err.print(f"[red]error:[/red] {escape(lines[0])}", markup=True)
            for line in lines[1:]:
                err.print(line, markup=False)
            code = EXIT_TIMEOUT if isinstance(exc, WaitTimeout) else EXIT_USAGE
            raise typer.Exit(exc.exit_code if isinstance(exc, ApiError) else code) from None

    return wrapper


def http_call(method: str, url: str, **kw: Any) -> httpx.Response:
    kw["headers"] = {**client_auth_headers(), **(kw.get("headers") or {})}
    try:
        return httpx.request(method, url, **kw)
    except httpx.HTTPError as exc:
        raise ApiError(
            [f"cannot reach the API at {url}: {one_line(str(exc))} (is `vlab up` running?)"],
            EXIT_UNAVAILABLE,
        ) from None


def submit_spec(
    api: str, spec: dict[str, Any], out: Console | None = None
) -> dict[str, Any] | None:
    """``POST /api/v1/experiments``; the created experiment, its runs' URLs printed on
    ``out`` (default the console). A refusal raises :class:`ApiError` (printed once by
    :func:`friendly`: the count of problems, then one line each)."""
    out = out or console
    resp = http_call("POST", f"{api}/api/v1/experiments", json=spec, timeout=300)
    if resp.status_code != 201:
        code = EXIT_USAGE if resp.status_code < 500 else EXIT_UNAVAILABLE
        raise ApiError(problem_lines(resp), code)
    created: dict[str, Any] = resp.json()
    # URLs are never wrapped (a terminal or a log must be able to open them whole)
    out.print(
        f"experiment [bold]{created['id']}[/bold]: {page_url(created['url'])}", soft_wrap=True
    )
    for run in created["runs"]:
        line = f"  run {run['name']} (repeat {repeat_number(run)}): {page_url(run['url'])}"
        out.print(line, soft_wrap=True, markup=False)
    estimate = created.get("capacity_estimate")
    if isinstance(estimate, dict) and estimate.get("experiment_s_max") is not None:
        out.print(
            f"capacity search: at most {estimate['experiment_s_max'] / 60:.0f} min of load in "
            f"all ({estimate.get('note', '')})",
            markup=False,
        )
    return created
