"""What the dashboard shows of a capacity search (issue #15): the result in words, the
steps table, the latency-vs-load chart documents, the per-variant capacity cells of the
experiment ladder, and the Pareto chart of output tokens/s per device against tokens/s
per user across an experiment's runs.

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
from collections.abc import Iterable, Mapping
from typing import Any

from orchestrator.analysis.trust import step_untrusted

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


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


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
    obj = _num(objective)
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
                    "objective": _num(c.get("objective")),
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
        if s.get("verdict") == "fail" and s.get("saturated") and _num(s.get("load")) is not None
    ]
    for step in sorted(failing, key=lambda s: _num(s.get("load")) or 0.0):
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
    steps = _steps(doc)
    interval = list(doc.get("interval") or [None, None]) + [None, None]
    low, high = _num(interval[0]), _num(interval[1])
    cap = _num(doc.get("capacity"))
    client_ceiling = _num(doc.get("client_ceiling"))
    binding = binding_text(doc)
    loads = [v for v in (_num(s.get("load")) for s in steps) if v is not None]

    def load(v: float | None) -> str:
        return f"{fmt_load(v, variable)} {unit}".strip()

    def rate(v: float) -> str:  # the load generator's ceiling is a request rate
        return f"{fmt_load(v, 'request_rate')} req/s"

    n = len(steps)
    tried = f"{n} load step{'' if n == 1 else 's'}"
    found = status == "found" and cap is not None
    if found:
        headline = load(cap)
        bracket = (
            f" (bracket {fmt_load(low, variable)}–{fmt_load(high, variable)} {unit})".rstrip()
            if low is not None and high is not None
            else ""
        )
        bound = f", bound by {binding}" if binding else ""
        sentence = f"{load(cap)}{bracket}{bound}: the highest load that met every SLO ({tried})."
    elif status == "below_min":
        lowest = min(loads) if loads else low
        headline = f"below {load(lowest)}"
        bound = f" ({binding})" if binding else ""
        sentence = (
            f"Below {load(lowest)}: the lowest load tried failed{bound}; no capacity within "
            f"the search range ({tried})."
        )
    elif status == "at_least_max":
        highest = max(loads) if loads else high
        headline = f"at least {load(highest)}"
        sentence = (
            f"At least {load(highest)}: the highest load tried met every SLO; the boundary "
            f"is above the search range ({tried})."
        )
        if client_ceiling is not None:
            sentence += f" The load generator's ceiling here is {rate(client_ceiling)}."
    elif status == "client_limited":
        headline = f"at least {load(low)}" if low is not None else "unknown"
        ceiling = (
            f"the load generator's ceiling here is {rate(client_ceiling)}"
            if client_ceiling is not None
            else "the load generator's ceiling here was not measured"
        )
        start = f"At least {load(low)}" if low is not None else "Unknown: no load passed"
        sentence = (
            f"{start}; {ceiling}: the search reached a load the load generator could not "
            f"deliver, so the server's boundary was not measured ({tried}). Scale the load "
            "generator out (more workers, or on other nodes) to measure beyond it."
        )
    elif status == "uncertain":
        last = next((s for s in reversed(steps) if s.get("verdict") == "uncertain"), None)
        at = f" at {load(_num(last.get('load')))}" if last is not None else ""
        straddle = _straddling(last) if last is not None else []
        why = (
            f": the interval of {', '.join(straddle)} straddles its objective"
            if straddle
            else ": a step's interval straddled its objective"
        )
        headline = "unknown"
        sentence = (
            f"Unknown: uncertain{at}{why} after re-measuring; no capacity is reported ({tried})."
        )
    elif status == "steps_exhausted":
        headline = "unknown"
        sentence = (
            f"Unknown: steps exhausted ({tried}) before the bracket narrowed to the "
            "tolerance; no capacity is reported."
        )
    else:
        headline = "unknown"
        sentence = f"Unknown: the search ended with status {status or '–'!r} ({tried})."
    return {
        "status": status,
        "status_text": STATUS_TEXT.get(status, status),
        "found": found,
        "headline": headline,
        "sentence": sentence,
        "unit": unit,
        "variable": variable,
        "variable_label": VARIABLE_LABELS.get(variable, variable),
        "capacity": cap if found else None,
        "low": low,
        "high": high,
        "binding": binding,
        "saturation_evidence": saturation_evidence(doc),
        "client_ceiling": client_ceiling,
        "steps": n,
        "note": doc.get("note"),
    }


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
                cells[(str(metric), str(pct))] = {"value": _num(value)}
        for (metric, pct), c in checks.items():
            if metric == "goodput" or not pct:
                continue
            cell = cells.setdefault((metric, str(pct)), {"value": None})
            cell.update(
                value=_num(c.get("value")) if cell["value"] is None else cell["value"],
                ci_low=_num(c.get("ci_low")),
                ci_high=_num(c.get("ci_high")),
                verdict=None if untrusted else c.get("verdict"),
                objective=_num(c.get("objective")),
            )
        raw_signals = step.get("signals")
        signals: dict[str, Any] = raw_signals if isinstance(raw_signals, dict) else {}
        good = None if untrusted else checks.get(("goodput", None))
        evidence = step.get("saturation_evidence")
        workers = signals.get("client_workers")
        rows.append(
            {
                "index": step.get("index", i),
                "load": _num(step.get("load")),
                "requests": step.get("requests"),
                "failed": step.get("failed"),
                "duration_s": _num(step.get("duration_s")),
                "cells": cells,
                "goodput": _num(step.get("goodput")),
                "goodput_check": good,
                "output_tokens_per_s": _num(step.get("output_tokens_per_s")),
                "output_tokens_per_s_per_user": _num(step.get("output_tokens_per_s_per_user")),
                "kv_cache_usage_max": _num(signals.get("kv_cache_usage_max")),
                "waiting_first": _num(signals.get("waiting_first")),
                "waiting_last": _num(signals.get("waiting_last")),
                "waiting_max": _num(signals.get("waiting_max")),
                "dispatch_lag_p99_ms": _num(signals.get("dispatch_lag_p99_ms")),
                "asked_rate": _num(signals.get("asked_rate")),
                "arrived_rate": _num(signals.get("arrived_rate")),
                "client_cpu": _num(signals.get("client_cpu")),
                "client_workers": workers if isinstance(workers, int) else None,
                "saturated": step.get("saturated"),
                "saturation_evidence": (
                    [str(e) for e in evidence] if isinstance(evidence, list) else []
                ),
                "stationary": step.get("stationary"),
                "warmup_requests": step.get("warmup_requests"),
                "measured_s": _num(step.get("measured_s")),
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
    steps = _steps(doc)
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
    for i, step in enumerate(steps):
        x = _num(step.get("load"))
        if x is None:
            continue
        limited = step_untrusted(step) is not None  # no pass/fail, no interval
        for c in _checks(step):
            target = charts.get(str(c["metric"]))
            if target is None:
                continue
            value = _num(c.get("value"))
            if value is None and c.get("percentile"):
                value = _num(
                    ((step.get("percentiles") or {}).get(c["metric"]) or {}).get(c["percentile"])
                )
            target["series"][c.get("percentile") or "value"]["points"].append(
                {
                    "x": x,
                    "y": value,
                    "lo": None if limited else _num(c.get("ci_low")),
                    "hi": None if limited else _num(c.get("ci_high")),
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
                    {"x": x, "y": _num(value), "lo": None, "hi": None, "verdict": None,
                     "step": step.get("index", i)}
                )  # fmt: skip
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


def experiment_curves(entries: Iterable[tuple[str, str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The experiment page's latency-vs-load overlay: per objective (``ttft_ms p99``) one
    series per capacity run. ``entries``: ``(run id, label, capacity document)``.

    ``{"unit", "variable_label", "objectives": [{"key", "label", "metric", "objective",
    "runs": [{"run_id", "label", "status", "capacity", "points": [{"x", "y", "lo", "hi",
    "verdict"}]}]}]}``; empty ``objectives`` when no run searched.
    """
    objs: dict[str, dict[str, Any]] = {}
    unit = variable_label = ""
    for run_id, label, doc in entries:
        c = curves(doc, label=label)
        unit, variable_label = unit or c["unit"], variable_label or c["variable_label"]
        for chart in c["charts"]:
            for o in chart["objectives"]:
                key = (
                    chart["metric"]
                    if not o["percentile"]
                    else f"{chart['metric']} {o['percentile']}"
                )
                entry = objs.setdefault(
                    key,
                    {
                        "key": key,
                        "label": o["label"],
                        "metric": chart["metric"],
                        "unit": chart["unit"],
                        "objective": o["objective"],
                        "runs": [],
                    },
                )
                series = next(
                    z
                    for z in chart["series"]
                    if z["checked"] and z["percentile"] == o["percentile"]
                )
                entry["runs"].append(
                    {
                        "run_id": run_id,
                        "label": label,
                        "status": c["status"],
                        "capacity": c["capacity"],
                        "points": series["points"],
                    }
                )
    return {"unit": unit, "variable_label": variable_label, "objectives": list(objs.values())}


def boundary_step(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The step measured at the capacity (the last passing step at that load) of a
    ``found`` search; None otherwise."""
    cap = _num(doc.get("capacity"))
    if doc.get("status") != "found" or cap is None:
        return None
    at = [
        s
        for s in _steps(doc)
        if s.get("verdict") == "pass" and (v := _num(s.get("load"))) is not None
        and math.isclose(v, cap, rel_tol=1e-9, abs_tol=1e-12)
    ]  # fmt: skip
    return at[-1] if at else None


def pareto_point(
    metrics: Mapping[str, float], capacity: Mapping[str, Any] | None, devices: int
) -> dict[str, Any] | None:
    """One run's point: ``{"x": output tokens/s per user, "y": output tokens/s per device,
    "throughput", "devices", "source"}``, or None when neither is known.

    With a found capacity whose boundary step carries ``output_tokens_per_s`` and
    ``output_tokens_per_s_per_user`` (mean over requests of output tokens / (E2EL -
    TTFT)), the point is that step (the run at its capacity). Otherwise the run's summary
    metrics: y = ``output_throughput`` / devices, x = 1000 / ``mean_tpot_ms`` (a user's
    decode speed; ``vllm bench sweep plot_pareto`` instead divides the output throughput by
    the request rate or concurrency).
    """
    devices = max(1, int(devices or 1))
    step = boundary_step(capacity) if capacity else None
    if step is not None:
        tput = _num(step.get("output_tokens_per_s"))
        per_user = _num(step.get("output_tokens_per_s_per_user"))
        if tput is not None and per_user is not None and per_user > 0:
            return {
                "x": per_user,
                "y": tput / devices,
                "throughput": tput,
                "devices": devices,
                "source": "capacity boundary step",
            }
    tput = _num(metrics.get("output_throughput"))
    tpot = _num(metrics.get("mean_tpot_ms"))
    if tput is None or tpot is None or tpot <= 0:
        return None
    return {
        "x": 1000.0 / tpot,
        "y": tput / devices,
        "throughput": tput,
        "devices": devices,
        "source": "run metrics (output_throughput, mean_tpot_ms)",
    }


def non_dominated(points: list[tuple[float, float]]) -> list[bool]:
    """Per point whether no other point is at least as good on both axes and better on
    one (both maximised: tokens/s per user and tokens/s per device)."""
    out = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            j != i and qx >= x and qy >= y and (qx > x or qy > y)
            for j, (qx, qy) in enumerate(points)
        )
        out.append(not dominated)
    return out


def pareto(runs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The Pareto chart document of an experiment.

    ``runs``: ``{"run_id", "variant", "repeat_index", "devices", "metrics",
    "capacity", "untrusted"}`` of its succeeded runs (``untrusted``: why a flag of the
    run taints its tokens/s per user or throughput, :mod:`orchestrator.analysis.trust`;
    such a run has no point: 1000 / a TPOT from token bursts is no user's speed).
    Returns ``{"points": [{"run_id", "variant", "label", "x", "y", "throughput",
    "devices", "source", "frontier"}], "frontier": [labels, by tokens/s per user],
    "variants": [names], "missing": [labels without a point], "untrusted": [{"run_id",
    "label", "reason"}]}``.
    """
    points: list[dict[str, Any]] = []
    missing: list[str] = []
    variants: list[str] = []
    untrusted: list[dict[str, Any]] = []
    for r in runs:
        label = f"{r['variant']} #{int(r.get('repeat_index') or 0) + 1}"
        if r["variant"] not in variants:
            variants.append(str(r["variant"]))
        if r.get("untrusted"):
            untrusted.append({"run_id": r["run_id"], "label": label, "reason": r["untrusted"]})
            continue
        p = pareto_point(r.get("metrics") or {}, r.get("capacity"), int(r.get("devices") or 1))
        if p is None:
            missing.append(label)
            continue
        points.append({"run_id": r["run_id"], "variant": r["variant"], "label": label, **p})
    flags = non_dominated([(p["x"], p["y"]) for p in points])
    for p, flag in zip(points, flags, strict=True):
        p["frontier"] = flag
    frontier = sorted((p for p in points if p["frontier"]), key=lambda p: (p["x"], -p["y"]))
    return {
        "points": points,
        "frontier": [p["label"] for p in frontier],
        "variants": variants,
        "missing": missing,
        "untrusted": untrusted,
    }


def capacity_cell(member: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A variant's ladder cell from its comparison ``capacity`` member
    (:class:`orchestrator.analysis.capacity_compare.CapacityComparison` dumped: ``ratio``,
    ``ci_low``, ``ci_high``, ``verdict``, ``per_device_*``, ``variable``, ``unit``,
    ``reference_capacity``, ``capacity``, ``reason``, ``notes``, and where the document
    has them ``statement``, ``per_device_statement``, ``bounds``, ``client_ceiling``,
    ``trustworthy``, ``untrusted_reason``); None when the member is absent or null."""
    if not isinstance(member, Mapping):
        return None
    variable = str(member.get("variable") or "request_rate")
    notes = member.get("notes")
    bounds, ceiling = member.get("bounds"), member.get("client_ceiling")
    return {
        "verdict": str(member.get("verdict") or "unknown"),
        "ratio": _num(member.get("ratio")),
        "ci_low": _num(member.get("ci_low")),
        "ci_high": _num(member.get("ci_high")),
        "per_device_ratio": _num(member.get("per_device_ratio")),
        "per_device_ci_low": _num(member.get("per_device_ci_low")),
        "per_device_ci_high": _num(member.get("per_device_ci_high")),
        "per_device_verdict": member.get("per_device_verdict"),
        "capacity": _num(member.get("capacity")),
        "reference_capacity": _num(member.get("reference_capacity")),
        "variable": variable,
        "unit": str(member.get("unit") or VARIABLE_UNITS.get(variable, "")),
        "reason": member.get("reason"),
        "notes": [str(n) for n in notes] if isinstance(notes, list) else [],
        "statement": member.get("statement"),
        "per_device_statement": member.get("per_device_statement"),
        "bounds": dict(bounds) if isinstance(bounds, Mapping) else {},
        "client_ceiling": dict(ceiling) if isinstance(ceiling, Mapping) else {},
        "trustworthy": member.get("trustworthy", True) is not False,
        "untrusted_reason": member.get("untrusted_reason"),
    }
