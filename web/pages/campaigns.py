"""Dashboard pages ``/campaigns`` and ``/campaigns/{id}``: tuning campaigns (issue 25).

``/campaigns`` lists every campaign (newest first, 50 a page, ``?page=N``): name, status,
objective, runs used. ``/campaigns/{id}`` shows one: its status and objective, the path as
a chart (each decided candidate's gain over its round's incumbent as a bar with its
interval as whiskers: the adopted steps and, beside them, the inert and worse ones), the
path and the candidates as tables (variable, from -> to, effect with its interval,
verdict, reason, the runs behind it linked to ``/runs/{id}``), the confirmation (the
measured total against the product of the step gains), where the wall time went (a small
table: waiting for devices, engine start-ups, measurement..., each with its share of the
campaign's elapsed time, and the server starts), the runs measured again with why (lost
to the infrastructure, or a finding flagged the objective), and the final configuration as
a ``vllm serve`` line and a re-run spec.

Everything is read from the campaign's stored result (what
:func:`orchestrator.tuning.service.advance` writes) and its runs as they are now, as
``GET /api/v1/campaigns/{id}`` reads them. Gains are stored as log ratios (positive is
better); the pages show them as percentages (``expm1``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from api.deps import SessionDep
from orchestrator.core.models import Campaign, Run
from orchestrator.core.repositories import CampaignRepository
from web.render import not_found, render

router = APIRouter()

#: campaigns per page of ``/campaigns``
LIST_PER_PAGE = 50
#: outcomes drawn in the chart, and their colour class
CHART_OUTCOMES = ("adopted", "inert", "worse", "marginal", "outpaid", "undecided", "unknown")
#: The wall-time kinds of a campaign's result (:mod:`orchestrator.tuning.wall_time`), in
#: the table's order, with their row names.
WALL_KINDS = (
    ("queue_wait_s", "waiting for devices"),
    ("startup_s", "engine start-ups"),
    ("warmup_s", "warm-up"),
    ("measure_s", "measurement"),
    ("stop_s", "stopping engines"),
    ("other_s", "other run time"),
    ("lost_s", "runs lost to the infrastructure"),
    ("between_s", "between cycles (deciding, queuing the next)"),
)
#: A retry's label: the first run's label and ``.retry<k>``.
_RETRY = re.compile(r"\.retry\d+$")


def pct(log_ratio: float | None) -> float | None:
    """A log-ratio gain as a percentage (``0.0953`` -> ``10.0``); None stays None."""
    if log_ratio is None or not math.isfinite(log_ratio):
        return None
    return math.expm1(log_ratio) * 100.0


def gain_view(gain: dict[str, Any] | None) -> dict[str, Any] | None:
    """A stored gain with its estimate and interval as percentages and as text
    (``+10.2 % [+7.9 %, +12.6 %]``); None when there is none."""
    if not gain:
        return None
    est, low, high = (pct(gain.get(k)) for k in ("estimate", "low", "high"))
    if est is None or low is None or high is None:
        return None
    return {
        "pct": est,
        "low": low,
        "high": high,
        "n": gain.get("n"),
        "confidence": gain.get("confidence"),
        "text": f"{est:+.1f} % [{low:+.1f} %, {high:+.1f} %]",
    }


def level_text(level: Any) -> str:
    """A level as the spec writes it (``true``, ``128``)."""
    return json.dumps(level) if isinstance(level, bool) or level is None else str(level)


def _runs_of(runs: list[Run], round_: int, label: str) -> list[Run]:
    """The runs of a round's candidate (labels ``r<round>.c<cycle>.<candidate label>``,
    and their retries ``...<candidate label>.retry<k>``)."""
    out = []
    for run in runs:
        parts = _RETRY.sub("", str(run.campaign_label or "")).split(".", 2)
        if len(parts) == 3 and parts[0] == f"r{round_}" and parts[2] == label:
            out.append(run)
    return out


def candidate_rows(result: dict[str, Any], runs: list[Run]) -> list[dict[str, Any]]:
    """Every candidate of every round for the templates: variable, from/to, outcome,
    verdict, effect (:func:`gain_view`), pairs, reason, and its runs."""
    rows = []
    for c in result.get("candidates", []):
        cand = c.get("candidate") or {}
        rows.append(
            {
                "round": c.get("round"),
                "label": c.get("label", ""),
                "variable": cand.get("variable", ""),
                "from": level_text(cand.get("from_level")),
                "to": level_text(cand.get("to_level")),
                "outcome": c.get("outcome", ""),
                "verdict": c.get("verdict"),
                "pairs": c.get("pairs", 0),
                "gain": gain_view(c.get("gain")),
                "reason": c.get("reason", ""),
                "runs": _runs_of(runs, c.get("round", 0), c.get("label", "")),
            }
        )
    return rows


def chart_doc(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The path chart's data: one bar per decided candidate with a gain, in round order
    (the adopted step of a round first, the others beside it): label, outcome, the gain
    and its interval in %."""
    bars = []
    for row in sorted(
        (r for r in rows if r["gain"] is not None and r["outcome"] in CHART_OUTCOMES),
        key=lambda r: (r["round"], r["outcome"] != "adopted"),
    ):
        bars.append(
            {
                "label": f"r{row['round']} {row['variable'].split('.', 1)[-1]} "
                f"{row['from']}→{row['to']}",
                "outcome": row["outcome"],
                "y": row["gain"]["pct"],
                "low": row["gain"]["low"],
                "high": row["gain"]["high"],
                "text": row["gain"]["text"],
            }
        )
    return {"bars": bars}


def wall_view(wall: dict[str, Any] | None) -> dict[str, Any] | None:
    """The wall-time table: each kind's seconds and share of the elapsed time (``None``
    when not recorded yet), and the server starts."""
    if not wall:
        return None
    elapsed = float(wall.get("elapsed_s") or 0.0)
    rows = []
    for key, name in WALL_KINDS:
        value = float(wall.get(key) or 0.0)
        share = f"{value / elapsed:.0%}" if elapsed > 0 else "–"
        rows.append({"key": key, "name": name, "s": f"{value:.1f}", "share": share})
    return {
        "rows": rows,
        "elapsed": f"{elapsed:.1f}",
        "server_starts": int(wall.get("server_starts") or 0),
        "servers_reused": int(wall.get("servers_reused") or 0),
    }


def campaign_view(row: Campaign, runs: list[Run]) -> dict[str, Any]:
    """One campaign for ``campaign.html`` (see the module docstring)."""
    result = row.result or {}
    request = row.request or {}
    rows = candidate_rows(result, runs)
    confirmation = result.get("confirmation")
    start = result.get("start") or {}
    incumbent = result.get("incumbent") or {}
    return {
        "c": row,
        "objective": request.get("objective") or {},
        "phase": result.get("phase"),
        "runs_used": result.get("runs_used", 0),
        "budget": result.get("budget", (request.get("budget") or {}).get("max_runs", 0)),
        "path": [
            {
                "round": s.get("round"),
                "variable": s.get("variable", ""),
                "from": level_text(s.get("from_level")),
                "to": level_text(s.get("to_level")),
                "verdict": s.get("verdict", ""),
                "gain": gain_view(s.get("gain")),
                "reason": s.get("reason", ""),
            }
            for s in result.get("path", [])
        ],
        "candidates": rows,
        "cumulative": gain_view(result.get("cumulative")),
        "confirmation": (
            {
                "total": gain_view(confirmation.get("total")),
                "steps": gain_view(confirmation.get("steps")),
                "interaction": gain_view(confirmation.get("interaction")),
                "agrees": bool(confirmation.get("agrees")),
            }
            if confirmation
            else None
        ),
        "confirm_runs": [r for r in runs if str(r.campaign_label or "").startswith("confirm.")],
        "final": [
            {
                "name": name,
                "level": level_text(level),
                "start": level_text(start.get(name)),
                "moved": name in start and start[name] != level,
            }
            for name, level in incumbent.items()
        ],
        "serve_command": result.get("serve_command"),
        "spec_json": json.dumps(result["spec"], indent=2) if result.get("spec") else None,
        "pending": result.get("pending", []),
        "wall": wall_view(result.get("wall_time")),
        "retried": result.get("retried") or {},
        "retry_reasons": result.get("retry_reasons") or {},
        "unmeasured": result.get("unmeasured") or {},
        "space_proposal": [
            {
                "name": str(n.get("name", "")),
                "proposed": bool(n.get("proposed")),
                "why": n.get("why"),
            }
            for n in result.get("space_proposal") or []
            if isinstance(n, dict)
        ],
        "space": [
            {"name": v.get("name"), "levels": ", ".join(level_text(x) for x in v.get("levels", []))}
            for v in request.get("space") or []
            if isinstance(v, dict)
        ],
        "chart": chart_doc(rows),
        "run_count": len(runs),
    }


def _page_number(raw: str | None) -> int:
    try:
        return max(1, int(raw or "1"))
    except ValueError:
        return 1


@router.get("/campaigns", response_class=HTMLResponse)
def campaigns(request: Request, session: SessionDep) -> HTMLResponse:
    """The campaign list, newest first, 50 a page (``?page=N``, 1-based)."""
    page = _page_number(request.query_params.get("page"))
    repo = CampaignRepository(session)
    rows, total = repo.page(limit=LIST_PER_PAGE, offset=(page - 1) * LIST_PER_PAGE)
    counts = repo.run_counts([r.id for r in rows])
    items = [
        {
            "c": r,
            "objective": str((r.request.get("objective") or {}).get("metric", "")),
            "phase": (r.result or {}).get("phase"),
            "adopted": len((r.result or {}).get("path", [])),
            "runs": counts.get(r.id, 0),
            "budget": ((r.request.get("budget") or {}).get("max_runs")),
        }
        for r in rows
    ]
    context = {
        "nav": "campaigns",
        "items": items,
        "total": total,
        "page": page,
        "pages": max(1, -(-total // LIST_PER_PAGE)),
    }
    return render(request, "campaigns.html", context)


@router.get("/campaigns/{campaign_id}", response_class=HTMLResponse)
def campaign(campaign_id: str, request: Request, session: SessionDep) -> HTMLResponse:
    """One campaign (see the module docstring); the 404 page when there is none."""
    repo = CampaignRepository(session)
    row = repo.get(campaign_id)
    if row is None:
        return not_found(request, f"No campaign {campaign_id}.")
    runs = [r for r in repo.runs(row.id) if r.campaign_label]
    context = {"nav": "campaigns", **campaign_view(row, runs)}
    return render(request, "campaign.html", context)
