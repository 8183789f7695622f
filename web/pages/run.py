"""Dashboard page ``/runs/{run_id}``: one run in full.

Server-rendered: the header (status, times, what changed vs the reference run,
progress), summary cards, the capacity under SLOs (when the run searched for it: the
result in words and the steps table, :mod:`web.capacity_view`), the full metrics table
(client-side, server-side and per request class), the per-class table, the
configuration and versions, the node layout (placement) and the node parity report.
In the browser (``web/static/js/run.js``, from the ``/api/v1`` JSON): the
latency-vs-load charts of a capacity search (``web/static/js/capacity.js``, from the
page's embedded JSON), the ``/metrics`` time series charts (with the engine events as
markers, ``web/static/js/runevents.js``; the events table is rendered here), the TTFT / E2EL
distributions of the measured requests, the filtered engine log, and the live refresh
while the run is active.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from api.deps import SessionDep
from api.schemas import ENGINE_EVENT_TYPES
from orchestrator.analysis.service import run_advice
from orchestrator.core.models import Run
from orchestrator.core.repositories import RunRepository
from orchestrator.core.states import ACTIVE
from web import capacity_view
from web.gpu_view import gpu_view
from web.render import not_found, render

router = APIRouter()


@dataclass(frozen=True)
class Card:
    """One summary card: ``metric`` key in ``run_metrics``, heading, unit and kind.

    ``kind``: ``ms`` / ``rate`` (a number shown with ``digits`` decimals) or
    ``pct`` (a 0-1 fraction shown as a percentage).
    """

    metric: str
    label: str
    unit: str
    kind: str = "ms"
    digits: int = 1
    optional: bool = False


CARDS: tuple[Card, ...] = (
    Card("median_ttft_ms", "TTFT p50", "ms"),
    Card("p99_ttft_ms", "TTFT p99", "ms"),
    Card("median_tpot_ms", "TPOT p50", "ms"),
    Card("median_itl_ms", "ITL p50", "ms"),
    Card("median_e2el_ms", "E2EL p50", "ms"),
    Card("output_throughput", "Output throughput", "tok/s", "rate"),
    Card("request_throughput", "Request throughput", "req/s", "rate", 2),
    Card("prefix_cache_hit_rate", "Prefix cache hit rate", "", "pct"),
    Card("request_goodput", "Goodput", "req/s", "rate", 2, optional=True),
    Card("goodput_fraction", "Requests within SLOs", "", "pct", optional=True),
    Card("energy_per_output_token_j", "Energy per output token", "J/token", "rate", 3, True),
    Card("gpu_mean_power_w", "Mean GPU power", "W per GPU", "rate", 1, True),
)

#: Per-class table columns: (metric suffix, heading, kind).
CLASS_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("completed", "Completed", "count"),
    ("failed", "Failed", "count"),
    ("median_ttft_ms", "TTFT p50 (ms)", "ms"),
    ("p99_ttft_ms", "TTFT p99 (ms)", "ms"),
    ("median_tpot_ms", "TPOT p50 (ms)", "ms"),
    ("median_itl_ms", "ITL p50 (ms)", "ms"),
    ("median_e2el_ms", "E2EL p50 (ms)", "ms"),
    ("p99_e2el_ms", "E2EL p99 (ms)", "ms"),
    ("total_input_tokens", "Input tokens", "count"),
    ("total_output_tokens", "Output tokens", "count"),
    ("output_throughput", "Output tok/s", "rate"),
    ("request_throughput", "Requests/s", "rate"),
    ("request_goodput", "Goodput (req/s)", "rate"),
)

_SERVER_PREFIXES = ("server_", "kv_cache_usage", "num_requests_", "gpu_prefix_cache")
_SERVER_EXACT = {"prefix_cache_hit_rate", "prefix_cache_hit_rate_blocks"}
#: GPU telemetry metrics (:func:`jobs.signals.gpus.summarize_gpu_samples`): ``gpu_*`` and
#: ``energy_*``.
_GPU_PREFIXES = ("gpu_", "energy_")
#: Units of the GPU telemetry metrics, by name suffix (``_pct`` is 0-100, not a fraction).
_GPU_UNITS = (("_per_output_token_j", "J/token"), ("_j", "J"), ("_w", "W"), ("_mib", "MiB"))

TIMING_LABELS = {
    "startup_s": "server start-up (to /health)",
    "warmup_s": "warm-up requests",
    "measure_s": "measured phase",
    "stop_s": "server stop",
    "total_s": "total",
    "startup_saved_s": "start-up saved (server reused)",
}


def metric_unit(name: str) -> str:
    """The display unit of a metric from its name (``vllm bench serve`` conventions).

    ``*_ms`` -> ``ms``; ``*_s`` -> ``s``; ``output/total_token_throughput`` ->
    ``tok/s``; ``request_throughput``/``request_goodput`` -> ``req/s``; hit
    rates, fractions and KV cache usage (0-1) -> ``%``; token counts and
    ``*_delta`` counters -> ``tokens`` / ``count``. GPU telemetry (``gpu_*``,
    ``energy_*``): ``J``, ``J/token``, ``W``, ``MiB`` and ``%`` (``*_pct``: already 0-100,
    not a fraction).
    """
    base = name.rpartition(".")[2]
    if base.startswith(_GPU_PREFIXES) and not base.startswith("gpu_prefix_cache"):
        if base.endswith("_pct"):
            return "%"
        return next((u for suffix, u in _GPU_UNITS if base.endswith(suffix)), "")
    if base.endswith("_ms"):
        return "ms"
    if base.endswith("_s") or base == "duration":
        return "s"
    if base in ("output_throughput", "total_token_throughput"):
        return "tok/s"
    if base in ("request_throughput", "request_goodput"):
        return "req/s"
    if "hit_rate" in base or "fraction" in base or base.startswith("kv_cache_usage"):
        return "%"
    if "tokens" in base:
        return "tokens"
    return ""


def metric_group(name: str) -> str:
    """``client`` (measured by the load generator, ``vllm bench serve`` names),
    ``server`` (from the engine's ``/metrics``: ``server_*`` histograms, counter
    deltas, KV cache usage, queue peaks, prefix cache hit rate), ``gpu`` (GPU
    telemetry: energy, power, memory, utilisation) or ``class``
    (``<class>.<metric>``)."""
    if "." in name:
        return "class"
    if name.startswith(_SERVER_PREFIXES) or name.endswith("_delta") or name in _SERVER_EXACT:
        return "server"
    if name.startswith(_GPU_PREFIXES):
        return "gpu"
    return "client"


def format_metric(name: str, value: float | None) -> str:
    """A metric value for the tables: percentages for 0-1 fractions, thousands
    separators, 3 significant decimals for small numbers; ``–`` when missing."""
    if value is None:
        return "–"
    unit = metric_unit(name)
    if unit == "%" and name.endswith("_pct"):
        return f"{value:.1f}"
    if unit == "%":
        return f"{value * 100:.1f}"
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    if abs(value) < 10:
        return f"{value:,.3f}"
    return f"{value:,.1f}"


def group_metrics(metrics: dict[str, float]) -> dict[str, list[tuple[str, str, str]]]:
    """``{"client"|"server"|"class": [(name, formatted value, unit)]}``, names sorted."""
    groups: dict[str, list[tuple[str, str, str]]] = {
        "client": [],
        "server": [],
        "gpu": [],
        "class": [],
    }
    for name in sorted(metrics):
        groups[metric_group(name)].append(
            (name, format_metric(name, metrics[name]), metric_unit(name))
        )
    return groups


def per_class(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """``{class: {metric: value}}`` from ``"<class>.<metric>"`` keys (classes sorted);
    empty when the run has a single request class (no prefixed keys)."""
    out: dict[str, dict[str, float]] = {}
    for name, value in metrics.items():
        cls, dot, metric = name.partition(".")
        if dot:
            out.setdefault(cls, {})[metric] = value
    return dict(sorted(out.items()))


@dataclass
class ParityRow:
    """One finding of a parity report, ready for the table.

    ``values``: per node name the text shown; ``odd``: the nodes whose value is
    the odd one out (highlighted); ``problems``: per node (or ``cluster``) why;
    ``copies``: per node that lacks the setting without a problem of its own (the
    majority lacks it), whether copying the value set elsewhere would work there (the
    finding's ``copy_check``; an odd node's problem already says it).
    """

    field: str
    severity: str
    rule: str
    values: dict[str, str]
    odd: list[str]
    problems: dict[str, str] = dataclasses.field(default_factory=dict)
    copies: dict[str, str] = dataclasses.field(default_factory=dict)


def _short(value: Any) -> str:
    if value is None:
        return "(not set)"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def parity_rows(report: dict[str, Any]) -> list[ParityRow]:
    """The findings of an :func:`orchestrator.cluster.parity.check_parity` report as table rows,
    blocking ones first (report order within a severity).

    A field finding gives its per-node values; a model-directory finding (one per
    node) puts ``missing``/``differs``/``extra`` files (or the missing directory)
    in that node's column.
    """
    rows: list[ParityRow] = []
    for finding in [*report.get("mismatches", []), *report.get("warnings", [])]:
        odd = [str(n) for n in finding.get("odd_nodes", [])]
        if finding.get("field") == "model_files" and "node" in finding:
            node = str(finding["node"])
            if "missing_model_path" in finding:
                text = f"model directory missing: {finding['missing_model_path']}"
            else:
                parts = [
                    f"{k}: {', '.join(map(str, finding[k]))}"
                    for k in ("missing", "differs", "extra")
                    if finding.get(k)
                ]
                text = "; ".join(parts)
            values = {node: text}
        else:
            values = {str(n): _short(v) for n, v in (finding.get("values") or {}).items()}
        rows.append(
            ParityRow(
                field=str(finding.get("field")),
                severity=str(finding.get("severity", "blocking")),
                rule=str(finding.get("rule", "")),
                values=values,
                odd=odd,
                problems={str(k): str(v) for k, v in (finding.get("problems") or {}).items()},
                copies={
                    str(node): "; ".join(str(i.get("message", "")) for i in items)
                    for node, items in (finding.get("copy_check") or {}).items()
                    if str(node) not in (finding.get("problems") or {})
                },
            )
        )
    rows.sort(key=lambda r: r.severity != "blocking")
    return rows


def engine_arg_rows(run: Run) -> list[tuple[str, str, bool, bool]]:
    """``[(name, JSON value, set explicitly, the variable this run changes)]`` sorted
    by name; explicitly set arguments come first."""
    explicit = run.explicit_engine_args or {}
    changed = {p.removeprefix("engine_args.") for p in (run.variable_paths or [])}
    changed |= {k.removeprefix("engine_args.") for k in (run.changes or {})}
    names = sorted(set(run.engine_args or {}) | set(explicit))
    rows = [
        (
            n,
            json.dumps((run.engine_args or {}).get(n, explicit.get(n)), default=str),
            n in explicit,
            n in changed,
        )
        for n in names
    ]
    rows.sort(key=lambda r: (not r[2], r[0]))
    return rows


#: Marker and swatch colour of each engine event type (the table's and the charts').
EVENT_COLORS = {
    "out_of_memory": "#cf222e",
    "nccl_error": "#8250df",
    "gloo_error": "#bf3989",
    "engine_dead": "#82071e",
    "worker_died": "#a40e26",
    "unhealthy": "#bc4c00",
    "health_check_failed": "#9a6700",
    "preemption": "#d4a72c",
    "restart": "#1a7f37",
}
#: Most engine events listed on the page (the API pages through all of them).
MAX_EVENT_ROWS = 300


def events_view(engine_info: dict[str, Any]) -> dict[str, Any]:
    """The run page's "Engine events": ``recorded`` (the run stored events: false means
    unknown, not none), ``rows`` (the first :data:`MAX_EVENT_ROWS` events, log order),
    ``total`` (events stored), ``summary`` (``engine_events_summary``), ``types``
    (type -> meaning, with a colour, of the types present), ``markers`` (``{t_s,
    type, color, label}`` of the placed events, for the time-series charts) and
    ``notes`` (stats lines dropped or ignored). Pops its keys from ``engine_info``."""
    stored = engine_info.pop("engine_events", None)
    summary = engine_info.pop("engine_events_summary", None)
    notes = engine_info.pop("stats_notes", None)
    events = [e for e in stored if isinstance(e, dict)] if isinstance(stored, list) else []
    present = {str(e.get("type")) for e in events}
    markers = [
        {
            "t_s": e["t_s"],
            "type": str(e.get("type")),
            "color": EVENT_COLORS.get(str(e.get("type")), "#1f2328"),
            "label": str(e.get("type")),
        }
        for e in events
        if e.get("placement") == "placed" and isinstance(e.get("t_s"), int | float)
    ]
    return {
        "recorded": isinstance(stored, list),
        "rows": events[:MAX_EVENT_ROWS],
        "total": len(events),
        "summary": summary if isinstance(summary, dict) else None,
        "types": {
            t: (ENGINE_EVENT_TYPES.get(t, ""), EVENT_COLORS.get(t, "#1f2328"))
            for t in ENGINE_EVENT_TYPES
            if t in present
        },
        "colors": EVENT_COLORS,
        "markers": markers,
        "notes": [n for n in notes if isinstance(n, dict)] if isinstance(notes, list) else [],
    }


def model_facts(run: Run, resolution: dict[str, Any] | None) -> list[tuple[str, str]]:
    """``[(label, text)]`` about where the model came from: the pinned revision
    (Hugging Face snapshot commit) and how the node resolved the name (source,
    offline, weights cached, file count, HF cache); empty when neither is known."""
    out: list[tuple[str, str]] = []
    res = resolution if isinstance(resolution, dict) else {}
    revision = run.model_revision or res.get("revision")
    if revision:
        out.append(("model_revision", str(revision)))
    if res.get("source"):
        parts = [str(res["source"])]
        if res.get("offline") is not None:
            parts.append("offline" if res["offline"] else "online")
        if res.get("weights_cached") is not None:
            parts.append("weights cached" if res["weights_cached"] else "weights not cached")
        files = res.get("files")
        count = len(files) if isinstance(files, list) else files
        if isinstance(count, int) and not isinstance(count, bool):
            parts.append(f"{count:,} file{'' if count == 1 else 's'}")
        if res.get("hf_cache"):
            parts.append(f"HF cache {res['hf_cache']}")
        out.append(("model source", " · ".join(parts)))
        path = res.get("path") or res.get("node_path")
        if path and path != run.model_path:
            out.append(("resolved path (node)", str(path)))
    return out


def progress_text(progress: dict[str, Any] | None) -> str:
    """``measuring · 12 / 64 requests · <message>`` from a run's progress report."""
    if not progress:
        return ""
    parts = [str(progress["phase"])] if progress.get("phase") else []
    total = progress.get("requests_total") or 0
    if total:
        parts.append(f"{progress.get('requests_done', 0)} / {total} requests")
    msg = progress.get("message")
    if msg and msg != progress.get("phase"):
        parts.append(str(msg))
    return " · ".join(parts)


def _duration(run: Run, since: datetime | None) -> float | None:
    """Seconds from ``since`` to the run's end (None until both are known)."""
    if since and run.finished_at:
        return (run.finished_at - since).total_seconds()
    return None


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(run_id: str, request: Request, session: SessionDep) -> HTMLResponse:
    """The run page; the HTML 404 page for an unknown id."""
    repo = RunRepository(session)
    run = repo.get(run_id)
    if run is None:
        return not_found(request, f"No run {run_id}.")
    reference = repo.get(run.reference_run_id) if run.reference_run_id else None
    metrics = repo.metrics(run_id)
    has_log = repo.log(run_id) is not None
    classes = per_class(metrics)
    engine_info = dict(run.engine_info or {})
    kv_check = engine_info.pop("kv_cache_check", None)
    prefix_analysis = engine_info.pop("prefix_analysis", None)
    findings = [] if run.status in ACTIVE else run_advice(session, run_id)
    startup_facts = engine_info.pop("startup_facts", None) or {}
    histogram_notes = engine_info.pop("histogram_notes", None) or []
    histogram_notes += engine_info.pop("counter_notes", None) or []  # /metrics counters
    # jobs.signals.cachecheck
    cache_check = engine_info.pop("cache_contamination", None) or None
    events = events_view(engine_info)
    resolution = engine_info.pop("model_resolution", None) or (
        (run.experiment.spec or {}).get("model_resolution") if run.experiment else None
    )
    gpus = gpu_view(engine_info, run.placement, metrics, active=run.status in ACTIVE)
    engine_info.pop("gpu_assignment", None)
    engine_info.pop("gpu_telemetry", None)
    cards = [c for c in CARDS if not c.optional or c.metric in metrics]
    parity = run.parity
    search = run.capacity if isinstance(run.capacity, dict) else None
    context = {
        "nav": "runs",
        "run": run,
        "experiment": run.experiment,
        "reference": reference,
        "active": run.status in ACTIVE,
        "duration_s": _duration(run, run.claimed_at or run.started_at),
        "measuring_s": _duration(run, run.started_at) if run.claimed_at else None,
        "progress_text": progress_text(run.progress) if run.status in ACTIVE else "",
        "metrics": metrics,
        "cards": cards,
        "groups": group_metrics(metrics),
        "classes": classes,
        "class_columns": CLASS_COLUMNS,
        "engine_args": engine_arg_rows(run),
        "startup_facts": startup_facts,
        "histogram_notes": histogram_notes,
        "cache_check": cache_check,
        "events": events,
        "engine_info_rest": engine_info,
        "timings": run.timings or {},
        "timing_labels": TIMING_LABELS,
        "placement": run.placement,
        "gpus": gpus,
        "model_facts": model_facts(run, resolution),
        "parity": parity,
        "parity_rows": parity_rows(parity) if parity else [],
        "parity_nodes": [str(n) for n in (parity or {}).get("nodes", [])],
        "has_log": has_log,
        "findings": findings,
        "kv_check": kv_check,
        "prefix_analysis": prefix_analysis,
        "pretty": _pretty,
        "fmt_metric": format_metric,
        "capacity": capacity_view.summary(search) if search else None,
        "capacity_steps": capacity_view.step_rows(search) if search else [],
        "capacity_columns": capacity_view.percentile_columns(search) if search else [],
        "capacity_curves": capacity_view.curves(search) if search else None,
        "capacity_objectives": capacity_view.objectives(search) if search else [],
        "fmt_load": capacity_view.fmt_load,
        "metric_labels": capacity_view.METRIC_LABELS,
    }
    return render(request, "run.html", context)
