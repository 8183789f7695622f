"""What the experiment page shows of its runs' capacity searches (issue #15): the
latency-vs-load overlay of every search, the per-variant capacity cells of the ladder
(from the comparison's ``capacity`` members), and the Pareto chart of output tokens/s
per device against tokens/s per user across the runs.

One search's views (its words, steps and curves) are :mod:`web.capacity_view`. No
verdict from an untrustworthy number (:mod:`orchestrator.analysis.trust`): a run whose
tokens/s per user a flag taints has no point in the Pareto chart.

Pure: no database, no HTTP (the page hands in what the services read).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from orchestrator.analysis.trust import finite_number
from web.capacity_view import VARIABLE_UNITS, boundary_step, curves


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
        "ratio": finite_number(member.get("ratio")),
        "ci_low": finite_number(member.get("ci_low")),
        "ci_high": finite_number(member.get("ci_high")),
        "per_device_ratio": finite_number(member.get("per_device_ratio")),
        "per_device_ci_low": finite_number(member.get("per_device_ci_low")),
        "per_device_ci_high": finite_number(member.get("per_device_ci_high")),
        "per_device_verdict": member.get("per_device_verdict"),
        "capacity": finite_number(member.get("capacity")),
        "reference_capacity": finite_number(member.get("reference_capacity")),
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
        tput = finite_number(step.get("output_tokens_per_s"))
        per_user = finite_number(step.get("output_tokens_per_s_per_user"))
        if tput is not None and per_user is not None and per_user > 0:
            return {
                "x": per_user,
                "y": tput / devices,
                "throughput": tput,
                "devices": devices,
                "source": "capacity boundary step",
            }
    tput = finite_number(metrics.get("output_throughput"))
    tpot = finite_number(metrics.get("mean_tpot_ms"))
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
