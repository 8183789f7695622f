"""Dashboard page ``/experiments/{id}``: the ladder, verdicts with 95 % CIs, a chart, findings.

The page is rendered on the server from :func:`orchestrator.analysis.service.comparison`
(each variant against its reference, hierarchical bootstrap, 2000 draws) plus a
per-level estimate of every compared metric (:func:`level_estimates`, used for
the baseline's own point and interval in the chart). The chart data is embedded
in the page as JSON (``<script type="application/json" id="chart-data">``).

Live: while a run is active the page's script polls ``GET /api/v1/experiments/{id}``
(every 3 s) and updates the run statuses in place; when a run finishes it fetches
this page again and swaps in the new ladder, findings and chart data.

Capacity under SLOs (issue #15), when the experiment's runs searched for it: a ladder
column per variant from the comparison document's ``capacity`` member (ratio with its
interval and verdict; nothing is computed here), the runs' latency-vs-load curves with
the SLO lines, and the Pareto chart of output tokens/s per device against tokens/s per
user across the succeeded runs with the non-dominated runs marked
(:mod:`web.experiment_capacity`).

Results are cached per experiment while the set of run ids and statuses does not
change (a terminal run never changes again; only succeeded runs are compared).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from sqlalchemy.orm import Session

from api.deps import SessionDep
from orchestrator.analysis.compare import METRICS, METRICS_BY_NAME, MetricSpec, RunData
from orchestrator.analysis.estimates import level_estimates
from orchestrator.analysis.service import comparison, experiment_advice, runs_as_data
from orchestrator.analysis.trust import (
    RunTrust,
    level_trust,
    na_text,
    objectives_of_capacity,
    runs_not_applicable,
    runs_reason,
    trust_of,
)
from orchestrator.core.models import Experiment, Run
from orchestrator.core.repositories import ExperimentRepository
from orchestrator.core.states import ACTIVE
from orchestrator.experiments.status import experiment_status, server_reuse
from web import experiment_capacity
from web.render import PageCache, not_found, render

router = APIRouter()

#: Metrics shown in the ladder table: (metric name, heading with unit).
KEY_METRICS: tuple[tuple[str, str], ...] = (
    ("median_ttft_ms", "TTFT p50 (ms)"),
    ("p99_ttft_ms", "TTFT p99 (ms)"),
    ("median_tpot_ms", "TPOT p50 (ms)"),
    ("median_e2el_ms", "E2EL p50 (ms)"),
    ("output_throughput", "Output throughput (tok/s)"),
    ("prefix_cache_hit_rate", "Prefix cache hit rate (%)"),
)

_RUN_LABELS = {
    "output_throughput": "Output token throughput",
    "request_throughput": "Request throughput",
    "total_token_throughput": "Total token throughput",
    "request_goodput": "Goodput",
    "goodput_fraction": "Goodput fraction",
    "prefix_cache_hit_rate": "Prefix cache hit rate",
    "kv_cache_usage_peak": "KV cache usage peak",
    "num_requests_waiting_peak": "Waiting requests peak",
    "server_mean_queue_ms": "Server queue time, mean",
    "server_mean_prefill_ms": "Server prefill time, mean",
    "server_mean_decode_ms": "Server decode time, mean",
}

DEFAULT_METRIC = "median_ttft_ms"
_CACHE_SIZE = 32
_cache = PageCache(_CACHE_SIZE)


def metric_label(spec: MetricSpec) -> str:
    """Human heading with unit, e.g. ``TTFT p50 (ms)``, ``Prefix cache hit rate (%)``."""
    if spec.level == "request":
        stat, short, _ = spec.name.split("_")
        stat = "p50" if stat == "median" else stat
        return f"{short.upper()} {stat} ({spec.unit})"
    base = _RUN_LABELS.get(spec.name, spec.name)
    unit = "%" if spec.unit == "fraction" else spec.unit
    return f"{base} ({unit})"


def _short_path(path: str) -> str:
    """``engine_args.enable_prefix_caching`` -> ``enable_prefix_caching`` (vLLM's own name)."""
    section, _, name = path.partition(".")
    return name if section in ("engine_args", "layout") and name else path


def _changes(variant: dict[str, Any], chain: dict[str, Any]) -> list[dict[str, Any]]:
    """The changed variable as ``[{"name", "path", "reference", "value"}]`` (one per path)."""
    paths = list(chain.get("paths") or variant.get("variable_paths") or [])
    if not paths:
        return []
    ref, new = chain.get("reference_value"), chain.get("variant_value")
    missing = "reference_value" not in chain
    out = []
    for p in paths:
        if missing:
            r, v = None, (variant.get("changes") or {}).get(p)
        elif len(paths) == 1:
            r, v = ref, new
        else:
            r = ref.get(p) if isinstance(ref, dict) else None
            v = new.get(p) if isinstance(new, dict) else None
        out.append(
            {"name": _short_path(p), "path": p, "reference": r, "value": v, "known": not missing}
        )
    return out


def _ci_on_scale(reference: float, row: dict[str, Any]) -> tuple[float | None, float | None]:
    """A variant's CI on the metric's scale from its comparison row.

    ``ci_of == "ratio"``: reference x [ci_low, ci_high]; ``"difference"``:
    reference + [ci_low, ci_high]; (None, None) when there is no interval.
    """
    lo, hi = row.get("ci_low"), row.get("ci_high")
    if lo is None or hi is None:
        return None, None
    if row.get("ci_of") == "ratio":
        return reference * lo, reference * hi
    return reference + lo, reference + hi


def _na(row: dict[str, Any] | None, side: str) -> str | None:
    """``n/a (off)`` when the comparison row says ``side`` cannot have the metric."""
    why = ((row or {}).get("not_applicable") or {}).get(side)
    return na_text(why) if why else None


def _na_own(flags: list[Any], metric: str) -> str | None:
    why = runs_not_applicable(flags, metric)
    return na_text(why) if why else None


def _build(session: Session, exp: Experiment) -> dict[str, Any]:
    """Comparison, ladder rows and chart document of one experiment (see module docstring)."""
    runs = list(exp.runs)
    cmp = comparison(session, exp.id)
    chain = {c["variant"]: c for c in cmp["chain"]}
    compared = {v["variant"]: v for v in cmp["variants"]}
    variants = sorted(
        exp.variants,
        key=lambda v: (v.get("reference") is not None, v.get("position", 0)),
    )
    by_name = _runs_by_name(runs)
    data = runs_as_data(session, runs)
    own = _own_estimates(variants, compared, data)
    ladder = []
    chart_points: dict[str, list[dict[str, Any]]] = {m.name: [] for m in METRICS}
    labels = []
    for v in variants:
        name, ref = v["name"], v.get("reference")
        entry = chain.get(name, {})
        comp = compared.get(name)
        rows = {m["metric"]: m for m in (comp or {}).get("metrics", [])}
        changes = _changes(v, entry)
        flags = level_trust(data.get(name, []))
        cells = _cells(rows, own[name], flags, ref is None)
        ladder.append(
            {
                "name": name,
                "position": v.get("position", 0),
                "reference": ref,
                "variable": v.get("variable"),
                "changes": changes,
                "runs": by_name.get(name, []),
                "succeeded": entry.get("succeeded", 0),
                "notes": (comp or {}).get("notes", []),
                "cells": cells,
            }
        )
        label = [name]
        for ch in changes:
            label.append(f"{ch['name']}={_text(ch['value'])}")
        labels.append(label)
        for spec in METRICS:
            mine = own[name].get(spec.name)
            point = _chart_point(name, ref, rows.get(spec.name), mine, flags, spec.name)
            chart_points[spec.name].append(point)
    chart = {
        "experiment_id": exp.id,
        "labels": labels,
        "default": DEFAULT_METRIC,
        "metrics": [
            {
                "name": m.name,
                "label": metric_label(m),
                "unit": m.unit,
                "direction": m.direction,
                "points": chart_points[m.name],
            }
            for m in METRICS
        ],
    }
    findings = experiment_advice(session, exp.id, cmp)
    return {
        "comparison": cmp,
        "ladder": ladder,
        "chart": chart,
        "findings": findings,
        **_capacity(exp, ladder, compared, data),
    }


def _runs_by_name(runs: list[Run]) -> dict[str, list[dict[str, Any]]]:
    """Each level's runs in order, as plain data (the result is cached)."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(runs, key=lambda r: (r.position, r.repeat_index)):
        by_name.setdefault(r.name, []).append(
            {
                "id": r.id,
                "repeat_index": r.repeat_index,
                "status": r.status,
                "status_reason": r.status_reason,
                "partial": r.partial,
            }
        )
    return by_name


def _own_estimates(
    variants: list[dict[str, Any]],
    compared: dict[str, dict[str, Any]],
    data: dict[str, list[RunData]],
) -> dict[str, dict[str, dict[str, float | None]]]:
    """Each level's own estimates: every metric for the baseline, only what the comparison
    lacks for the others (e.g. a metric the reference never had)."""
    own: dict[str, dict[str, dict[str, float | None]]] = {}
    for v in variants:
        name = v["name"]
        rows = {m["metric"]: m for m in compared.get(name, {}).get("metrics", [])}
        missing = {m.name for m in METRICS if m.name not in rows}
        if v.get("reference") is None:
            own[name] = level_estimates(data.get(name, []))
        else:
            own[name] = level_estimates(data.get(name, []), only=missing) if missing else {}
    return own


def _cells(
    rows: dict[str, dict[str, Any]],
    own: dict[str, dict[str, float | None]],
    flags: list[RunTrust],
    baseline: bool,
) -> list[dict[str, Any]]:
    """A ladder row's cells, one per key metric."""
    cells = []
    for metric, heading in KEY_METRICS:
        spec = METRICS_BY_NAME[metric]
        row = rows.get(metric)
        cells.append(
            {
                "metric": metric,
                "heading": heading,
                "fraction": spec.unit == "fraction",
                "row": row,
                "own": own.get(metric),
                "baseline": baseline,
                # the level's own value: greyed without its interval when flagged
                "untrusted": runs_reason(flags, metric),
                "na": _na(row, "variant") or _na_own(flags, metric),
                "reference_na": _na(row, "reference"),
            }
        )
    return cells


def _chart_point(
    name: str,
    ref: str | None,
    row: dict[str, Any] | None,
    mine: dict[str, float | None] | None,
    flags: list[RunTrust],
    metric: str,
) -> dict[str, Any]:
    """One level's point of one metric: against its reference, else its own estimate."""
    point: dict[str, Any] = {
        "variant": name,
        "reference": ref,
        "value": None,
        "ci_low": None,
        "ci_high": None,
        "ci_source": None,
        "verdict": None,
    }
    if row is not None:
        lo, hi = _ci_on_scale(row["reference"], row)
        point.update(
            value=row["variant"],
            ci_low=lo,
            ci_high=hi,
            ci_source="vs reference" if lo is not None else None,
            verdict=row["verdict"],
            untrusted_reason=row.get("untrusted_reason"),
        )
    elif mine is not None:
        why = runs_reason(flags, metric)
        point.update(
            value=mine["value"],
            ci_low=None if why else mine["ci_low"],
            ci_high=None if why else mine["ci_high"],
            ci_source="own" if mine["ci_low"] is not None and not why else None,
            verdict="untrusted" if why else None,
            untrusted_reason=why,
        )
    return point


def _capacity(
    exp: Experiment,
    ladder: list[dict[str, Any]],
    compared: dict[str, dict[str, Any]],
    data: dict[str, list[Any]],
) -> dict[str, Any]:
    """The capacity parts of the page: each ladder entry's ``capacity`` cell (the
    comparison member; a reference level shows the reference capacity its variants were
    compared against) and ``capacity_notes``, ``capacity_shown``, ``capacity_unit``, the
    ``capacity_curves`` overlay and the ``pareto`` document (succeeded runs; devices:
    what each run reserved)."""
    runs = sorted(exp.runs, key=lambda r: (r.position, r.repeat_index))
    searches = [r for r in runs if isinstance(r.capacity, dict)]
    _capacity_cells(ladder, compared)
    pareto = _pareto(runs, data)
    curves = experiment_capacity.experiment_curves(
        (r.id, f"{r.name} #{r.repeat_index + 1}", r.capacity or {}) for r in searches
    )
    shown = (
        bool(searches)
        or any(e["capacity"] for e in ladder)
        or bool((exp.spec or {}).get("capacity"))
    )
    units = [e["capacity"]["unit"] for e in ladder if e["capacity"] and e["capacity"]["unit"]]
    return {
        "capacity_shown": shown,
        "capacity_unit": units[0] if units else curves["unit"],
        "capacity_curves": curves,
        "pareto": pareto,
    }


def _capacity_cells(ladder: list[dict[str, Any]], compared: dict[str, dict[str, Any]]) -> None:
    """Each ladder entry's ``capacity`` cell, ``capacity_notes`` and ``own_capacity`` (a
    reference level: the capacity its variants were compared against)."""
    reference_capacity: dict[str, dict[str, Any]] = {}
    for entry in ladder:
        cell = experiment_capacity.capacity_cell(compared.get(entry["name"], {}).get("capacity"))
        entry["capacity"] = cell
        entry["capacity_notes"] = (
            ([f"capacity unknown: {cell['reason']}"] if cell["reason"] else [])
            + (
                [f"capacity not compared: {cell['untrusted_reason']}"]
                if cell["untrusted_reason"]
                else []
            )
            + [f"capacity: {n}" for n in cell["notes"]]
            if cell
            else []
        )
        shown = cell and (
            cell["reference_capacity"] is not None
            or cell["bounds"].get("reference") not in (None, "unknown")
        )
        if cell and shown and entry["reference"]:
            reference_capacity.setdefault(entry["reference"], cell)
    for entry in ladder:
        ref_cell = reference_capacity.get(entry["name"])
        entry["own_capacity"] = None
        if ref_cell:  # a found capacity, or the bound it showed ("at least 24")
            entry["own_capacity"] = {
                "value": ref_cell["reference_capacity"],
                "text": ref_cell["bounds"].get("reference"),
                "unit": ref_cell["unit"],
            }


def _pareto(runs: list[Run], data: dict[str, list[Any]]) -> dict[str, Any]:
    """The Pareto document of the succeeded runs, each point with what taints it."""
    metrics = {d.run_id: d for ds in data.values() for d in ds}

    def pareto_taint(run_id: str, capacity: dict[str, Any] | None) -> str | None:
        """Why a flag of the run taints its Pareto point (tokens/s per user from TPOT,
        or its throughput), or None."""
        if run_id not in metrics:
            return None
        trust = trust_of(metrics[run_id], objectives_of_capacity(capacity))
        return trust.reason("output_tokens_per_s_per_user") or trust.reason("output_throughput")

    return experiment_capacity.pareto(
        {
            "run_id": r.id,
            "variant": r.name,
            "repeat_index": r.repeat_index,
            "devices": metrics[r.id].devices if r.id in metrics else 1,
            "metrics": metrics[r.id].metrics if r.id in metrics else {},
            "capacity": r.capacity if isinstance(r.capacity, dict) else None,
            "untrusted": pareto_taint(r.id, r.capacity if isinstance(r.capacity, dict) else None),
        }
        for r in runs
        if r.status == "succeeded"
    )


def _text(value: Any) -> str:
    """A configuration value as shown in labels: ``true``, ``64``, ``fp8``."""
    if isinstance(value, bool):
        return str(value).lower()
    return "–" if value is None else str(value)


def analysis(session: Session, exp: Experiment) -> dict[str, Any]:
    """``{"comparison", "ladder", "chart", "findings", "capacity_shown",
    "capacity_unit", "capacity_curves", "pareto"}`` of ``exp`` (findings: the advisor's, in rollback
    order), cached while its runs' ids and statuses are unchanged (at most
    ``_CACHE_SIZE`` experiments)."""
    key = (exp.id, tuple(sorted((r.id, r.status) for r in exp.runs)))
    hit: dict[str, Any] | None = _cache.get(key)
    if hit is not None:
        return hit
    result = _build(session, exp)
    _cache.put(key, result)
    return result


def _context(session: Session, exp: Experiment) -> dict[str, Any]:
    runs = list(exp.runs)
    result = analysis(session, exp)
    return {
        "nav": "runs",
        "exp": exp,
        "status": experiment_status(runs),
        "run_count": len(runs),
        "reuse": server_reuse(runs),
        "active": any(r.status in ACTIVE for r in runs),
        "key_metrics": KEY_METRICS,
        "ladder": result["ladder"],
        "findings": result["findings"],
        "chart": result["chart"],
        # only metrics some level has a value for (no goodput without SLOs, ...); the
        # default stays selectable so the chart is never without a choice
        "metrics": [
            (m["name"], m["label"])
            for m in result["chart"]["metrics"]
            if m["name"] == DEFAULT_METRIC or any(p["value"] is not None for p in m["points"])
        ],
        "default_metric": DEFAULT_METRIC,
        "capacity_shown": result["capacity_shown"],
        "capacity_curves": result["capacity_curves"],
        "capacity_unit": result["capacity_unit"],
        "pareto": result["pareto"],
        "variant_names": [v["name"] for v in result["ladder"]],
    }


@router.get("/experiments/{experiment_id}", response_class=HTMLResponse)
def experiment_page(experiment_id: str, request: Request, session: SessionDep) -> HTMLResponse:
    """The experiment page (404 page for an unknown id)."""
    exp = ExperimentRepository(session).get(experiment_id)
    if exp is None:
        return not_found(request, f"No experiment {experiment_id}.")
    return render(request, "experiment.html", _context(session, exp))
