"""What several routers share: the pagination parameters and a run's JSON shape."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query, Request

from api.schemas import RunBrief, RunOut
from orchestrator.core.models import Run

Limit = Annotated[int, Query(ge=1, le=500)]
Offset = Annotated[int, Query(ge=0, le=10**12)]


#: A path parameter value no id contains: where a built URL's id goes.
_SLOT = "vlab-id-slot"

#: The fields of :class:`RunOut` a :class:`Run` row has (the others: ``url``, ``metrics``).
_RUN_FIELDS = tuple(k for k in RunOut.model_fields if hasattr(Run, k))


def url_for_id(request: Request, route: str, **param: str) -> str:
    """``request.url_for(route, name=value)`` for a route with one path parameter.

    ``url_for`` walks the application's routes on every call (0.2 ms each, a fifth of a
    50-run page); this builds the route's URL once per request and puts each id in it.
    """
    ((name, value),) = param.items()
    cache: dict[str, tuple[str, str]] | None = getattr(request.state, "url_templates", None)
    if cache is None:
        cache = request.state.url_templates = {}
    parts = cache.get(route)
    if parts is None:
        url = str(request.url_for(route, **{name: _SLOT}))
        cut = url.rindex(_SLOT)
        parts = cache[route] = (url[:cut], url[cut + len(_SLOT) :])
    return parts[0] + value + parts[1]


def run_url(request: Request, run_id: str) -> str:
    return url_for_id(request, "get_run", run_id=run_id)


def run_brief(request: Request, r: Run) -> RunBrief:
    return RunBrief(
        id=r.id,
        name=r.name,
        position=r.position,
        repeat_index=r.repeat_index,
        sequence=r.sequence,
        status=r.status,
        url=run_url(request, r.id),
    )


def run_out(request: Request, run: Run, metrics: dict[str, float] | None = None) -> RunOut:
    data: dict[str, Any] = {k: getattr(run, k) for k in _RUN_FIELDS}
    data["url"] = run_url(request, run.id)
    data["metrics"] = metrics
    return RunOut.model_validate(data)
