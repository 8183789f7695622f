"""Dashboard page ``/``: the run history (filter, sort, server-side pagination).

Query parameters: ``model``, ``status``, ``experiment`` (id or part of the name),
``engine_arg`` (``name=value``, value read as JSON), ``since``/``until`` (dates,
``YYYY-MM-DD``, UTC, ``until`` inclusive), ``sort`` (a column key of
:data:`orchestrator.runs.history.SORT_KEYS`), ``dir`` (``asc``/``desc``), ``page``
(1-based), ``per_page`` and ``cursor`` (the "next" link's keyset cursor: the page after
the previous one's last row, as fast at any depth; ``page`` then only labels it). Counts
above a thousand runs are estimated ("about N"). Bad values re-render the page with the error and a
422 status. ``?fragment=rows`` returns only the table body (live refresh).
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from api.deps import SessionDep
from orchestrator.core.states import ACTIVE, RunStatus
from orchestrator.runs.history import (
    SORT_KEYS,
    HistoryFilter,
    HistoryQueryError,
    distinct_models,
    history_page,
    parse_engine_arg,
)
from web.render import render

router = APIRouter()

PER_PAGE = (25, 50, 100, 200)
COLUMNS: list[tuple[str, str, bool]] = [
    # (sort key, heading, numeric)
    ("experiment", "Experiment", False),
    ("model", "Model", False),
    ("variable", "Change", False),
    ("status", "Status", False),
    ("started", "Started", False),
    ("duration", "Duration", True),
    ("ttft_p50", "TTFT p50 (ms)", True),
    ("ttft_p99", "TTFT p99 (ms)", True),
    ("e2el_p50", "E2EL p50 (ms)", True),
    ("output_throughput", "Output tok/s", True),
    ("hit_rate", "Prefix cache hit rate", True),
]


COLUMN_HELP = {
    "started": "when the run began (its vLLM server up, or reused), UTC",
    "duration": "from the run's start to its end: warm-up and the measured phase; the "
    "server's start-up is in the run's timings",
    "hit_rate": "prefix cache hits / queries over the measured phase, in tokens",
}


def _date(field: str, raw: str) -> date:
    try:
        return date.fromisoformat(raw)
    except ValueError:
        raise HistoryQueryError(field, f"{field} must be a date YYYY-MM-DD, got {raw!r}") from None


def _int(field: str, raw: str, lo: int, hi: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise HistoryQueryError(field, f"{field} must be a whole number, got {raw!r}") from None
    if not lo <= value <= hi:
        raise HistoryQueryError(field, f"{field} must be between {lo} and {hi}, got {value}")
    return value


def parse_query(params: dict[str, str]) -> tuple[HistoryFilter, str, bool, int, int]:
    """Query parameters -> (filter, sort, descending, page, per_page).

    Raises:
        HistoryQueryError: the first bad parameter, named.
    """
    status = params.get("status") or None
    if status and status not in {s.value for s in RunStatus}:
        raise HistoryQueryError("status", f"unknown status {status!r}")
    since = until = None
    if params.get("since"):
        d = _date("since", params["since"])
        since = datetime(d.year, d.month, d.day, tzinfo=UTC)
    if params.get("until"):
        d = _date("until", params["until"])
        until = datetime(d.year, d.month, d.day, tzinfo=UTC) + timedelta(days=1)
    if since and until and until <= since:
        raise HistoryQueryError("until", "until must not be before since")
    engine_arg = parse_engine_arg(params["engine_arg"]) if params.get("engine_arg") else None
    flt = HistoryFilter(
        model=params.get("model") or None,
        status=status,
        experiment=(params.get("experiment") or "").strip() or None,
        engine_arg=engine_arg,
        since=since,
        until=until,
    )
    sort = params.get("sort") or "submitted"
    if sort not in SORT_KEYS:
        raise HistoryQueryError("sort", f"unknown sort column {sort!r}")
    direction = params.get("dir") or params.get("order") or "desc"  # order: the API's name
    if direction not in ("asc", "desc"):
        raise HistoryQueryError("dir", f"dir must be asc or desc, got {direction!r}")
    page = _int("page", params.get("page") or "1", 1, 10**9)
    per_page = _int("per_page", params.get("per_page") or "50", 1, max(PER_PAGE))
    return flt, sort, direction == "desc", page, per_page


@router.get("/", response_class=HTMLResponse)
def history(request: Request, session: SessionDep) -> HTMLResponse:
    params = {k: v for k, v in request.query_params.items() if v != ""}
    error: HistoryQueryError | None = None
    try:
        flt, sort, desc, page, per_page = parse_query(params)
    except HistoryQueryError as exc:
        error = exc
        flt, sort, desc, page, per_page = HistoryFilter(), "submitted", True, 1, 50
    cursor = None if error else params.get("cursor")
    try:
        result = history_page(
            session,
            flt,
            sort=sort,
            descending=desc,
            limit=per_page,
            offset=0 if cursor else (page - 1) * per_page,
            cursor=cursor,
            brief=True,
        )
    except HistoryQueryError as exc:  # a cursor of another sort, or mangled
        error = exc
        result = history_page(session, flt, sort=sort, descending=desc, limit=per_page, brief=True)
    if error is not None:  # show the error, not an unfiltered table that looks filtered
        result.rows, result.total, result.next_cursor = [], 0, None
    models = distinct_models(session)
    pages = max(1, -(-result.total // per_page))
    if result.estimated:
        pages = max(pages, page + (1 if result.next_cursor else 0))
    past_end = result.total > 0 and page > pages

    def link(**changes: Any) -> str:
        q = {k: v for k, v in params.items() if k != "fragment"}
        if "page" in changes or "sort" in changes:  # a cursor marks a place in one order
            q.pop("cursor", None)
        q.update({k: str(v) for k, v in changes.items()})
        return "/?" + urlencode({k: v for k, v in q.items() if v != ""})

    context = {
        "nav": "runs",
        "params": params,
        "error": error,
        "rows": result.rows,
        "total": result.total,
        "estimated": result.estimated,
        "next_cursor": result.next_cursor,
        "page": page,
        "pages": pages,
        "per_page": per_page,
        "per_page_options": PER_PAGE,
        "sort": sort,
        "desc": desc,
        "columns": COLUMNS,
        "column_help": COLUMN_HELP,
        "statuses": [s.value for s in RunStatus],
        "models": models,
        "link": link,
        "past_end": past_end,
        "active": any(r.run.status in ACTIVE for r in result.rows),
    }
    template = "history_rows.html" if params.get("fragment") == "rows" else "history.html"
    return render(request, template, context, 422 if error else 200)
