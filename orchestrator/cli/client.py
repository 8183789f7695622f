"""The ``vlab`` commands' one client of the REST API, their exit codes and their output.

Every command that reads or changes the service goes through :class:`Api` (``httpx``,
``VLAB_TOKEN`` sent as a bearer token); none opens the database behind the service.
An error answer (problem+json) becomes one :class:`ApiError`, printed once on stderr by
:func:`orchestrator.cli.common.friendly`: ``error: <title> (<status>): <detail>``, or, when
the problem lists fields, the count and then one line per field (the detail restates
them, so it is not printed too).

Exit codes (documented in docs/USAGE.md, "Exit codes"): :data:`EXIT_OK` 0,
:data:`EXIT_FAILED` 1 (a run failed, was cancelled or blocked; a comparison or a scheduled
sweep found a regression), :data:`EXIT_USAGE` 2 (a bad argument or file, or the service
refused the request: 4xx), :data:`EXIT_TIMEOUT` 3 (``--wait-timeout`` passed with runs
unfinished), :data:`EXIT_UNAVAILABLE` 4 (the service cannot be reached or failed: 5xx).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import typer
from rich.console import Console

from orchestrator.cli.specfile import CliError
from orchestrator.core.settings import get_settings

#: The environment variable holding the API token the commands send, as a bearer token
#: (the demo sets it for the commands it runs: :mod:`orchestrator.cli.runtime`).
TOKEN_ENV = "VLAB_TOKEN"


def client_auth_headers() -> dict[str, str]:
    """``Authorization`` for the command line's API calls, from ``VLAB_TOKEN`` if set."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    return {"authorization": f"Bearer {token}"} if token else {}


EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_UNAVAILABLE = 4

#: The widest the commands' tables get, terminal or not (wider terminals keep 100).
TABLE_WIDTH = 100


def make_console() -> Console:
    """Standard output for tables and lines: at most :data:`TABLE_WIDTH` columns (the
    terminal's width when narrower); not a terminal (logs, CI): exactly that, no colour."""
    if sys.stdout.isatty():
        return Console(width=min(shutil.get_terminal_size().columns, TABLE_WIDTH))
    return Console(width=TABLE_WIDTH, color_system=None)


def check_api_url(value: str | None) -> str | None:
    """``--api``: an ``http(s)://host[:port]`` base URL, else a usage error (exit 2), not
    an attempt to reach it (which would say "cannot reach", exit 4)."""
    if value is None:
        return value
    parts = urlsplit(value.strip())
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise typer.BadParameter(
            f"{value!r} is not the API's base URL: give http(s)://host[:port], "
            "e.g. http://127.0.0.1:8000"
        )
    return value


def check_uuid(value: str | None) -> str | None:
    """An id option (``--experiment-id``): a UUID as the API gives ids, else a usage error
    (exit 2) rather than a filter that matches nothing."""
    if value is None:
        return value
    try:
        uuid.UUID(value)
    except ValueError:
        raise typer.BadParameter(
            f"{value!r} is not an id (a UUID such as those `vlab experiments list` shows)"
        ) from None
    return value


def page_url(url: str) -> str:
    """The dashboard's page for an API resource URL, what a person opens:
    ``<base>/api/v1/runs/<id>`` -> ``<base>/runs/<id>`` (experiments and campaigns alike;
    the base, a public URL or a path prefix included, kept). ``--json`` keeps the API's."""
    head, sep, tail = url.partition("/api/v1/")
    return f"{head}/{tail}" if sep else url


def repeat_number(run: dict[str, Any]) -> int:
    """A run's repeat as people count it (from 1, as the dashboard and MLflow name it);
    the API's ``repeat_index`` counts from 0."""
    return int(run.get("repeat_index", 0)) + 1


def run_label(run: dict[str, Any]) -> str:
    """``<variant> #<repeat>``, e.g. ``apc-on #1``."""
    return f"{run['name']} #{repeat_number(run)}"


def say_unsuccessful(exp: dict[str, Any]) -> None:
    """``N of M run(s) did not succeed: <run> <status>, ...`` on standard error (one line,
    however narrow the terminal): why ``submit``, ``watch`` and ``experiments show`` exit 1."""
    bad = [r for r in exp["runs"] if r["status"] != "succeeded"]
    Console(stderr=True, soft_wrap=True).print(
        f"{len(bad)} of {len(exp['runs'])} run(s) did not succeed: "
        + ", ".join(f"{run_label(r)} {r['status']}" for r in bad),
        markup=False,
    )


class WaitTimeout(TimeoutError):
    """``--wait-timeout`` passed with runs unfinished: exit code 3. ``document`` is what
    the API answered last (the experiment or campaign as it stands): printed on stdout
    with ``--json`` before the exit, so a CI script still has the id and the state."""

    def __init__(self, message: str, document: Any = None) -> None:
        super().__init__(message)
        self.document = document


class ApiError(CliError):
    """The service answered with an error, or could not be reached: the lines to print
    (the first the summary) and the exit code."""

    def __init__(self, lines: list[str], exit_code: int, status: int | None = None) -> None:
        super().__init__(lines[0])
        self.lines = lines
        self.exit_code = exit_code
        self.status = status


def problem_lines(resp: httpx.Response) -> list[str]:
    """A problem+json answer as lines, each problem once: ``<title> (<status>): <detail>``;
    with one field error ``<title> (<status>): <loc>: <msg>``; with several ``<title>
    (<status>): N problem(s)`` then ``  - <loc>: <msg>`` each (the detail, which restates
    them, is left out); a 401 or 403 adds what to do."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        text = " ".join(resp.text.split())[:500]
        return [f"HTTP {resp.status_code}: {text or resp.reason_phrase}"]
    errors = [e for e in body.get("errors") or [] if isinstance(e, dict)]
    title = str(body.get("title") or "error")

    def field(err: dict[str, Any]) -> str:
        return f"{'.'.join(map(str, err.get('loc') or []))}: {err.get('msg')}"

    if len(errors) == 1:  # the detail restates it: said once, on the summary line
        lines = [f"{title} ({resp.status_code}): {field(errors[0])}"]
    elif errors:
        lines = [f"{title} ({resp.status_code}): {len(errors)} problem(s)"]
        lines += [f"  - {field(err)}" for err in errors]
    else:
        lines = [f"{title} ({resp.status_code}): {' '.join(str(body.get('detail')).split())}"]
    if resp.status_code == 401:
        lines.append("  set VLAB_TOKEN to a token of the role needed (`vlab token create`)")
    elif resp.status_code == 403:
        lines.append("  VLAB_TOKEN's role may not do this: use a token with a higher role")
    return lines


class Api:
    """The service at ``base`` (``--api``, default the settings' API URL).

    ``call`` answers the JSON body of a 2xx answer (None for 204), else raises
    :class:`ApiError` (4xx: exit 2; 5xx or unreachable: exit 4)."""

    def __init__(self, base: str | None = None, timeout_s: float = 60.0) -> None:
        self.base = (base or get_settings().api_base_url()).rstrip("/")
        self.timeout_s = timeout_s

    def url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else f"{self.base}{path}"

    def call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json_body: Any = None,
        timeout_s: float | None = None,
    ) -> Any:
        url = self.url(path)
        kw: dict[str, Any] = {
            "headers": client_auth_headers(),
            "timeout": timeout_s or self.timeout_s,
        }
        if params:
            kw["params"] = {k: v for k, v in params.items() if v is not None}
        if json_body is not None:
            kw["json"] = json_body
        try:
            resp = httpx.request(method, url, **kw)
        except httpx.HTTPError as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise ApiError(
                [f"cannot reach the API at {self.base}: {reason} (is `vlab up` running?)"],
                EXIT_UNAVAILABLE,
            ) from None
        if resp.is_success:
            return None if resp.status_code == 204 or not resp.content else resp.json()
        code = EXIT_UNAVAILABLE if resp.status_code >= 500 else EXIT_USAGE
        raise ApiError(problem_lines(resp), code, resp.status_code)

    def get(self, path: str, **params: Any) -> Any:
        return self.call("GET", path, params=params)

    def pages(self, path: str, params: dict[str, Any], limit: int | None) -> Iterator[Any]:
        """The items of a paginated list (``{"items", "total", "limit", "offset"}``), at
        most ``limit`` of them (None: all), page after page: a ``next`` link or cursor
        when the answer carries one (``next`` / ``next_url`` a URL, ``next_cursor`` a
        cursor sent back as ``cursor``; one of them present but null: the last page), else
        the next offset until ``total``."""
        query = {k: v for k, v in params.items() if v is not None}
        page_size = min(limit or 100, 100)
        query["limit"] = page_size
        url = path
        seen = 0
        while True:
            body = self.call("GET", url, params=query)
            items = body.get("items") or []
            for item in items:
                if limit is not None and seen >= limit:
                    return
                yield item
                seen += 1
            nxt = body.get("next") or body.get("next_url")
            cursor = body.get("next_cursor")
            if isinstance(nxt, str) and nxt.startswith(("http://", "https://", "/")):
                url, query = nxt, {}
            elif isinstance(nxt, str) and nxt:
                query = {**query, "cursor": nxt}
                query.pop("offset", None)
            elif isinstance(cursor, str) and cursor:
                query = {**query, "cursor": cursor}
                query.pop("offset", None)
            elif any(k in body for k in ("next", "next_url", "next_cursor")):
                return  # a keyset page without a next one: the last
            elif "total" in body and int(body.get("offset", 0)) + len(items) < body["total"]:
                query = {**query, "offset": int(body.get("offset", 0)) + len(items)}
            else:
                return
            if not items or (limit is not None and seen >= limit):
                return


def print_json(doc: Any) -> None:
    """``doc`` as JSON on standard output (the API's shape, indented; nothing else)."""
    typer.echo(json.dumps(doc, indent=2, sort_keys=False, default=str))


@contextmanager
def json_on_timeout(json_out: bool) -> Iterator[None]:
    """With ``--json``, a :class:`WaitTimeout` prints its document on stdout (the
    experiment or campaign as the API answered it last) before it goes on to exit 3."""
    try:
        yield
    except WaitTimeout as exc:
        if json_out and exc.document is not None:
            print_json(exc.document)
        raise


def fail(exit_code: int) -> typer.Exit:
    """The exit for ``exit_code`` (raise it)."""
    return typer.Exit(exit_code)
