"""What the dashboard shows of a capacity search (issue #15): the result in words, the
steps table and the latency-vs-load chart documents of one search; what the experiment
page shows across its runs (the overlay, the ladder's capacity cells, the Pareto chart)
is :mod:`web.experiment_capacity`.

Inputs are stored documents as plain dicts, read defensively (a field may be missing):
``runs.capacity`` is ``jobs.capacity.search.CapacityResult.model_dump(mode="json")``
(``variable``, ``status`` found | below_min | at_least_max | client_limited |
uncertain | steps_exhausted, ``capacity``, ``interval`` [highest pass, lowest fail],
``client_ceiling`` (req/s the load generator sustains there), ``binding_slo``,
``steps`` [{``index``, ``load``, ``requests``, ``failed``, ``duration_s``,
``percentiles`` {metric: {"p50": ms, ...}}, ``goodput``, ``output_tokens_per_s``,
``output_tokens_per_s_per_user``, ``signals`` (``asked_rate``, ``arrived_rate``,
``client_cpu``, ``client_workers``, the queue and lag figures), ``checks``
[{``metric``, ``percentile``, ``objective``, ``value``, ``ci_low``, ``ci_high``,
``verdict``}], ``saturated``, ``saturation_evidence``, ``stationary``,
``warmup_requests``, ``measured_s``, ``verdict`` pass | fail | uncertain |
client_limited}], ``note``); the comparison document's per-variant ``capacity``
member is :mod:`orchestrator.analysis`'s. Nothing here computes a capacity: a search
whose status is not ``found`` shows no capacity figure. Fields newer than a document
are read with ``.get`` (older documents lack them).

No verdict from an untrustworthy number (:mod:`orchestrator.analysis.trust`): a
``client_limited`` step's checks and chart points carry no pass/fail (the load did not
arrive); "bound by saturation" is said only with the server's evidence, shown; a run
whose tokens/s per user a flag taints has no point in the Pareto chart.

Pure: no database, no HTTP (the pages hand in what the repositories and services read).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from orchestrator.analysis.trust import finite_number, step_untrusted

#: Display names of the SLO metrics (docs/ARCHITECTURE.md terms).
METRIC_LABELS = {
    "ttft_ms": "TTFT",
    "tpot_ms": "TPOT",
    "itl_ms": "ITL",
    "e2el_ms": "E2EL",
    "goodput": "Goodput",
}
#: The load variable's unit, short (figures) and long (headings).
VARIABLE_UNITS = {"request_rate": "req/s", "concurrency": "concurrent requests"}
VARIABLE_LABELS = {"request_rate": "request rate", "concurrency": "concurrency"}

#: What each search status means, in words (the headline of a search without a capacity).
STATUS_TEXT = {
    "found": "found",
    "below_min": "below the lowest load tried",
    "at_least_max": "at least the highest load tried",
    "client_limited": "at least the highest load the load generator delivered",
    "uncertain": "unknown: uncertain",
    "steps_exhausted": "unknown: steps exhausted",
}


def fmt_load(value: float | None, variable: str) -> str:
    """A load figure: concurrency as an integer when whole, a rate with 1-3 decimals."""
    if value is None:
        return "–"
    if variable == "concurrency" and float(value).is_integer():
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:,.1f}"
    text = f"{value:.2f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def percentile_rank(name: str) -> float:
    """``p99`` -> 99.0, ``p99.9`` -> 99.9, ``median``/``p50`` -> 50 (sort key)."""
    if name in ("median", "mean"):
        return 50.0 if name == "median" else -1.0
    m = re.fullmatch(r"p(\d+(?:\.\d+)?)", name)
    return float(m.group(1)) if m else 1000.0


def objective_text(metric: str, percentile: str | None, objective: float | None) -> str:
    """``TTFT p99 ≤ 500 ms``; goodput: ``goodput ≥ 90 %`` (the fraction of requests
    within every per-request objective)."""
    obj = finite_number(objective)
    if metric == "goodput":
        return "goodput ≥ " + ("–" if obj is None else f"{obj * 100:g} %")
    name = METRIC_LABELS.get(metric, metric)
    head = f"{name} {percentile}" if percentile else name
    return f"{head} ≤ " + ("–" if obj is None else f"{obj:g} ms")


def _steps(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [s for s in doc.get("steps") or [] if isinstance(s, dict)]


def _checks(step: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [c for c in step.get("checks") or [] if isinstance(c, dict) and c.get("metric")]


def objectives(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The SLOs the search checked, in first-checked order: ``[{"metric", "percentile",
    "objective", "key", "label"}]`` (``key``: ``"ttft_ms p99"``; ``goodput``: ``"goodput"``)."""
    out: dict[str, dict[str, Any]] = {}
    for step in _steps(doc):
        for c in _checks(step):
            metric, pct = str(c["metric"]), c.get("percentile")
            key = metric if not pct else f"{metric} {pct}"
            if key not in out:
                out[key] = {
                    "metric": metric,
                    "percentile": pct,
                    "objective": finite_number(c.get("objective")),
                    "key": key,
                    "label": objective_text(metric, pct, c.get("objective")),
                }
    return list(out.values())


def binding_objective(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The checked objective ``binding_slo`` names (``jobs.capacity.search`` writes
    ``"ttft_ms:p99"`` or ``"goodput"``; ``"ttft_ms p99"``, ``"ttft_ms.p99"`` match too), or
    None."""
    text = doc.get("binding_slo")
    if not text:
        return None
    text = str(text)
    objs = objectives(doc)
    for o in objs:
        if text == o["key"] or text == o["label"]:
            return o
    for o in objs:
        if not text.startswith(o["metric"]):
            continue
        rest = text[len(o["metric"]) :].lstrip(" .:/_-")
        if (o["percentile"] or "") == rest or (not rest and o["percentile"] is None):
            return o
    same_metric = [o for o in objs if text.startswith(o["metric"])]
    return same_metric[0] if len(same_metric) == 1 else None


def saturation_evidence(doc: Mapping[str, Any]) -> list[str]:
    """The server's evidence of saturation (waiting queue growth, KV cache full,
    preemptions, errors) of the lowest failing saturated step; [] when none was stored
    (older searches stored none)."""
    failing = [
        s
        for s in _steps(doc)
        if s.get("verdict") == "fail"
        and s.get("saturated")
        and finite_number(s.get("load")) is not None
    ]
    for step in sorted(failing, key=lambda s: finite_number(s.get("load")) or 0.0):
        evidence = step.get("saturation_evidence")
        if isinstance(evidence, list) and evidence:
            return [str(e) for e in evidence]
    return []


def binding_text(doc: Mapping[str, Any]) -> str | None:
    """The SLO that binds first, in words (``TTFT p99 ≤ 500 ms``; ``saturated``: the
    lowest failing step failed on saturation alone, said as the server saturating only
    with its evidence); the stored text when it names no checked objective; None when
    the search names none."""
    if doc.get("binding_slo") == "saturated":
        evidence = saturation_evidence(doc)
        if evidence:
            return (
                "saturation: the server saturated before any objective failed ("
                + "; ".join(evidence)
                + ")"
            )
        return (
            "a saturation signal without server evidence: the search stored none (it may "
            "be the load generator's own lag, not the server)"
        )
    o = binding_objective(doc)
    if o is not None:
        return str(o["label"])
    return str(doc["binding_slo"]) if doc.get("binding_slo") else None


def _straddling(step: Mapping[str, Any]) -> list[str]:
    return [
        objective_text(str(c["metric"]), c.get("percentile"), c.get("objective"))
        for c in _checks(step)
        if c.get("verdict") == "uncertain"
    ]


def summary(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The result in words: ``{"status", "found", "headline", "sentence", "unit",
    "variable", "capacity", "low", "high", "binding", "steps", "note"}``.

    ``headline`` is the capacity figure only when ``status == "found"`` (``4.2 req/s``);
    otherwise a word (``unknown``, ``below 1 req/s``, ``at least 8 req/s``) and never a
    capacity number. ``sentence`` says how the search ended.
    """
    variable = str(doc.get("variable") or "request_rate")
    unit = VARIABLE_UNITS.get(variable, "")
    status = str(doc.get("status") or "")
    interval = list(doc.get("interval") or [None, None]) + [None, None]
    low, high = finite_number(interval[0]), finite_number(interval[1])
    cap = finite_number(doc.get("capacity"))
    found = status == "found" and cap is not None
    words = _bound_words(doc, status, low, high) or _unknown_words(doc, status)
    return {
        "status": status,
        "status_text": STATUS_TEXT.get(status, status),
        "found": found,
        "headline": words[0],
        "sentence": words[1],
        "unit": unit,
        "variable": variable,
        "variable_label": VARIABLE_LABELS.get(variable, variable),
        "capacity": cap if found else None,
        "low": low,
        "high": high,
        "binding": binding_text(doc),
        "saturation_evidence": saturation_evidence(doc),
        "client_ceiling": finite_number(doc.get("client_ceiling")),
        "steps": len(_steps(doc)),
        "note": doc.get("note"),
    }


def _load_text(value: float | None, variable: str) -> str:
    """A load with its unit (``4.2 req/s``)."""
    return f"{fmt_load(value, variable)} {VARIABLE_UNITS.get(variable, '')}".strip()


def _tried(steps: list[dict[str, Any]]) -> str:
    n = len(steps)
    return f"{n} load step{'' if n == 1 else 's'}"


def _bound_words(
    doc: Mapping[str, Any], status: str, low: float | None, high: float | None
) -> tuple[str, str] | None:
    """``(headline, sentence)`` of a search that ended at a bound: a found capacity,
    below the range, at least its top, or at the load generator's ceiling; None for
    the others."""
    variable = str(doc.get("variable") or "request_rate")
    unit = VARIABLE_UNITS.get(variable, "")
    steps = _steps(doc)
    cap = finite_number(doc.get("capacity"))
    client_ceiling = finite_number(doc.get("client_ceiling"))
    binding = binding_text(doc)
    loads = [v for v in (finite_number(s.get("load")) for s in steps) if v is not None]
    tried = _tried(steps)
    ceiling_rate = f"{fmt_load(client_ceiling, 'request_rate')} req/s"  # a request rate
    if status == "found" and cap is not None:
        bracket = (
            f" (bracket {fmt_load(low, variable)}–{fmt_load(high, variable)} {unit})".rstrip()
            if low is not None and high is not None
            else ""
        )
        bound = f", bound by {binding}" if binding else ""
        return (
            _load_text(cap, variable),
            f"{_load_text(cap, variable)}{bracket}{bound}: the highest load that met every "
            f"SLO ({tried}).",
        )
    if status == "below_min":
        lowest = _load_text(min(loads) if loads else low, variable)
        bound = f" ({binding})" if binding else ""
        return f"below {lowest}", (
            f"Below {lowest}: the lowest load tried failed{bound}; no capacity within "
            f"the search range ({tried})."
        )
    if status == "at_least_max":
        highest = _load_text(max(loads) if loads else high, variable)
        sentence = (
            f"At least {highest}: the highest load tried met every SLO; the boundary "
            f"is above the search range ({tried})."
        )
        if client_ceiling is not None:
            sentence += f" The load generator's ceiling here is {ceiling_rate}."
        return f"at least {highest}", sentence
    if status == "client_limited":
        ceiling = (
            f"the load generator's ceiling here is {ceiling_rate}"
            if client_ceiling is not None
            else "the load generator's ceiling here was not measured"
        )
        at_least = f"At least {_load_text(low, variable)}"
        start = at_least if low is not None else "Unknown: no load passed"
        return (f"at least {_load_text(low, variable)}" if low is not None else "unknown"), (
            f"{start}; {ceiling}: the search reached a load the load generator could not "
            f"deliver, so the server's boundary was not measured ({tried}). Scale the load "
            "generator out (more workers, or on other nodes) to measure beyond it."
        )
    return None


def _unknown_words(doc: Mapping[str, Any], status: str) -> tuple[str, str]:
    """``("unknown", sentence)`` of a search that ended without a bound: uncertain, steps
    exhausted, or another status."""
    variable = str(doc.get("variable") or "request_rate")
    steps = _steps(doc)
    tried = _tried(steps)
    if status == "uncertain":
        last = next((s for s in reversed(steps) if s.get("verdict") == "uncertain"), None)
        at = (
            f" at {_load_text(finite_number(last.get('load')), variable)}"
            if last is not None
            else ""
        )
        straddle = _straddling(last) if last is not None else []
        why = (
            f": the interval of {', '.join(straddle)} straddles its objective"
            if straddle
            else ": a step's interval straddled its objective"
        )
        return "unknown", (
            f"Unknown: uncertain{at}{why} after re-measuring; no capacity is reported ({tried})."
        )
    if status == "steps_exhausted":
        return "unknown", (
            f"Unknown: steps exhausted ({tried}) before the bracket narrowed to the "
            "tolerance; no capacity is reported."
        )
    return "unknown", f"Unknown: the search ended with status {status or '–'!r} ({tried})."


def percentile_columns(doc: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``[(metric, percentile)]`` the steps table shows: every stored percentile of the
    metrics that have an objective (``goodput`` aside), by metric then percentile."""
    metrics = [o["metric"] for o in objectives(doc) if o["metric"] != "goodput"]
    cols: dict[str, set[str]] = {m: set() for m in dict.fromkeys(metrics)}
    for step in _steps(doc):
        for metric, pcts in (step.get("percentiles") or {}).items():
            if metric in cols and isinstance(pcts, dict):
                cols[metric].update(str(p) for p in pcts)
    for o in objectives(doc):
        if o["metric"] in cols and o["percentile"]:
            cols[o["metric"]].add(str(o["percentile"]))
    return [(m, p) for m, ps in cols.items() for p in sorted(ps, key=percentile_rank)]


def step_rows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per step in the order measured: ``{"index", "load", "requests", "failed",
    "duration_s", "cells": {(metric, pct): {"value", "ci_low", "ci_high", "verdict",
    "objective"}}, "goodput", "goodput_check", "output_tokens_per_s",
    "output_tokens_per_s_per_user", "kv_cache_usage_max", "waiting_first",
    "waiting_last", "waiting_max", "dispatch_lag_p99_ms", "asked_rate", "arrived_rate",
    "client_cpu", "client_workers", "saturated", "saturation_evidence", "stationary",
    "warmup_requests", "measured_s", "untrusted", "verdict"}``.

    A ``client_limited`` step (``untrusted``: why) keeps its values, but its cells and
    goodput carry no verdict: the load did not arrive, so nothing passed or failed."""
    rows = []
    for i, step in enumerate(_steps(doc)):
        untrusted = step_untrusted(step, VARIABLE_UNITS["request_rate"])
        checks = {(str(c["metric"]), c.get("percentile")): c for c in _checks(step)}
        cells: dict[tuple[str, str], dict[str, Any]] = {}
        for metric, pcts in (step.get("percentiles") or {}).items():
            for pct, value in (pcts or {}).items() if isinstance(pcts, dict) else ():
                cells[(str(metric), str(pct))] = {"value": finite_number(value)}
        for (metric, pct), c in checks.items():
            if metric == "goodput" or not pct:
                continue
            cell = cells.setdefault((metric, str(pct)), {"value": None})
            cell.update(
                value=finite_number(c.get("value")) if cell["value"] is None else cell["value"],
                ci_low=finite_number(c.get("ci_low")),
                ci_high=finite_number(c.get("ci_high")),
                verdict=None if untrusted else c.get("verdict"),
                objective=finite_number(c.get("objective")),
            )
        raw_signals = step.get("signals")
        signals: dict[str, Any] = raw_signals if isinstance(raw_signals, dict) else {}
        good = None if untrusted else checks.get(("goodput", None))
        evidence = step.get("saturation_evidence")
        workers = signals.get("client_workers")
        rows.append(
            {
                "index": step.get("index", i),
                "load": finite_number(step.get("load")),
                "requests": step.get("requests"),
                "failed": step.get("failed"),
                "duration_s": finite_number(step.get("duration_s")),
                "cells": cells,
                "goodput": finite_number(step.get("goodput")),
                "goodput_check": good,
                "output_tokens_per_s": finite_number(step.get("output_tokens_per_s")),
                "output_tokens_per_s_per_user": finite_number(
                    step.get("output_tokens_per_s_per_user")
                ),
                "kv_cache_usage_max": finite_number(signals.get("kv_cache_usage_max")),
                "waiting_first": finite_number(signals.get("waiting_first")),
                "waiting_last": finite_number(signals.get("waiting_last")),
                "waiting_max": finite_number(signals.get("waiting_max")),
                "dispatch_lag_p99_ms": finite_number(signals.get("dispatch_lag_p99_ms")),
                "asked_rate": finite_number(signals.get("asked_rate")),
                "arrived_rate": finite_number(signals.get("arrived_rate")),
                "client_cpu": finite_number(signals.get("client_cpu")),
                "client_workers": workers if isinstance(workers, int) else None,
                "saturated": step.get("saturated"),
                "saturation_evidence": (
                    [str(e) for e in evidence] if isinstance(evidence, list) else []
                ),
                "stationary": step.get("stationary"),
                "warmup_requests": step.get("warmup_requests"),
                "measured_s": finite_number(step.get("measured_s")),
                "untrusted": untrusted,
                "verdict": str(step.get("verdict") or ""),
            }
        )
    return rows


def curves(doc: Mapping[str, Any], *, label: str | None = None) -> dict[str, Any]:
    """The latency-vs-load chart document of one search (``web/static/js/capacity.js``).

    ``{"variable", "unit", "status", "capacity", "low", "high", "label", "charts":
    [{"metric", "title", "unit", "objectives": [{"percentile", "objective", "label"}],
    "series": [{"percentile", "checked", "points": [{"x", "y", "lo", "hi", "verdict",
    "step"}]}]}]}``: one chart per objective metric (goodput: the fraction of requests
    within the objectives); per chart a series per percentile with an objective (its
    bootstrap interval as ``lo``/``hi``, the step's verdict on that objective; a
    client-limited step's points: verdict ``client_limited``, no interval) and, for
    context, the other stored percentiles (``checked`` false, no interval). Points are
    sorted by load; a re-measured step is a point of its own.
    """
    s = summary(doc)
    charts = _chart_skeletons(doc)
    for i, step in enumerate(_steps(doc)):
        _add_points(charts, i, step)
    out = []
    for chart in charts.values():
        series = sorted(
            chart["series"].values(),
            key=lambda z: (not z["checked"], percentile_rank(z["percentile"] or "")),
        )
        for z in series:
            z["points"].sort(key=lambda p: (p["x"], p["step"]))
        out.append({**chart, "series": series})
    return {
        "variable": s["variable"],
        "variable_label": s["variable_label"],
        "unit": s["unit"],
        "status": s["status"],
        "capacity": s["capacity"],
        "low": s["low"] if s["found"] else None,
        "high": s["high"] if s["found"] else None,
        "label": label,
        "charts": out,
    }


def _chart_skeletons(doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """One empty chart per objective metric, a checked series per objective percentile."""
    charts: dict[str, dict[str, Any]] = {}
    for o in objectives(doc):
        chart = charts.setdefault(
            o["metric"],
            {
                "metric": o["metric"],
                "title": (
                    "Goodput (fraction of requests within the objectives)"
                    if o["metric"] == "goodput"
                    else f"{METRIC_LABELS.get(o['metric'], o['metric'])} (ms)"
                ),
                "unit": "fraction" if o["metric"] == "goodput" else "ms",
                "objectives": [],
                "series": {},
            },
        )
        chart["objectives"].append(
            {"percentile": o["percentile"], "objective": o["objective"], "label": o["label"]}
        )
        chart["series"][o["percentile"] or "value"] = {
            "percentile": o["percentile"],
            "checked": True,
            "points": [],
        }
    return charts


def _add_points(charts: dict[str, dict[str, Any]], i: int, step: Mapping[str, Any]) -> None:
    """A step's points: on each checked series (with interval and verdict unless the
    step is client-limited), then on each other stored percentile (no interval)."""
    x = finite_number(step.get("load"))
    if x is None:
        return
    limited = step_untrusted(step) is not None  # no pass/fail, no interval
    for c in _checks(step):
        target = charts.get(str(c["metric"]))
        if target is None:
            continue
        value = finite_number(c.get("value"))
        if value is None and c.get("percentile"):
            value = finite_number(
                ((step.get("percentiles") or {}).get(c["metric"]) or {}).get(c["percentile"])
            )
        target["series"][c.get("percentile") or "value"]["points"].append(
            {
                "x": x,
                "y": value,
                "lo": None if limited else finite_number(c.get("ci_low")),
                "hi": None if limited else finite_number(c.get("ci_high")),
                "verdict": "client_limited" if limited else c.get("verdict"),
                "step": step.get("index", i),
            }
        )
    for metric, pcts in (step.get("percentiles") or {}).items():
        target = charts.get(str(metric))
        if target is None or not isinstance(pcts, dict):
            continue
        for pct, value in pcts.items():
            series = target["series"].setdefault(
                str(pct), {"percentile": str(pct), "checked": False, "points": []}
            )
            if series["checked"]:
                continue
            series["points"].append(
                {"x": x, "y": finite_number(value), "lo": None, "hi": None, "verdict": None,
                 "step": step.get("index", i)}
            )  # fmt: skip


def boundary_step(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The step measured at the capacity (the last passing step at that load) of a
    ``found`` search; None otherwise."""
    cap = finite_number(doc.get("capacity"))
    if doc.get("status") != "found" or cap is None:
        return None
    at = [
        s
        for s in _steps(doc)
        if s.get("verdict") == "pass" and (v := finite_number(s.get("load"))) is not None
        and math.isclose(v, cap, rel_tol=1e-9, abs_tol=1e-12)
    ]  # fmt: skip
    return at[-1] if at else None
