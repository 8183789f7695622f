"""Dashboard page ``/compare?run=<id>&run=<id>...``: any runs side by side.

Query parameters: ``run`` (repeated; one value may also hold several ids
separated by spaces, commas or newlines, as the paste form sends them), ``ref``
(the reference run, one of the compared runs; default: the first selected run
that succeeded) and ``metric`` (the metric the chart opens on, a name of
:data:`KEY_METRICS`). ``POST /compare`` takes the same fields form-encoded, for
selections whose URL would be too long for a proxy in front of the service
(nginx refuses request lines over 8 KB by default: about 190 run ids; uvicorn
itself and Chromium take far longer URLs).

What the page shows:

- **settings that differ**: every run's configuration flattened to dotted keys
  (:func:`flatten_settings`); only keys whose values are not all equal are
  columns (:func:`settings_diff`); the identical ones are counted and listed.
- **metric deltas**: each succeeded run against the reference on
  :data:`KEY_METRICS` (:func:`orchestrator.analysis.side_by_side.compare_runs`: one
  repeat per side, a hierarchical bootstrap that degenerates to a request
  bootstrap, seed 0): the run's value, the ratio to the reference with its 95 %
  percentile-bootstrap interval, and the verdict. Bootstrap draws per comparison
  shrink with the number of comparisons (:func:`n_boot_for`) so 200 runs stay
  fast; the page says when it did.
- **chart**: one bar per run of the chosen metric; error bars are the
  comparison's interval put on the value scale (ratio CI x reference value, or
  reference value + difference CI). The data is embedded in the page as JSON
  (``<script type="application/json" id="compare-data">``).

Errors re-render the page with a 422 status: unknown run ids (named), more than
:data:`MAX_RUNS` runs, a ``ref`` that is not among the compared runs.

Results are cached while the selection, reference and statuses do not change
and every run is terminal (a terminal run never changes again).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse
from markupsafe import Markup, escape
from sqlalchemy.orm import Session

from api.deps import SessionDep
from orchestrator.analysis.compare import METRICS_BY_NAME
from orchestrator.analysis.service import compare_stored_runs
from orchestrator.analysis.side_by_side import Cell
from orchestrator.core.models import Run
from orchestrator.core.repositories import RunRepository
from orchestrator.core.states import ACTIVE
from web.render import PageCache, render

router = APIRouter()

#: Most runs one comparison takes (the page answers 422 above it).
MAX_RUNS = 500
#: Above this many runs (about 6 KB of URL) the reference form posts instead of using GET.
POST_ABOVE = 150
#: Compared metrics, in column order: (metric name of orchestrator.analysis.compare.METRICS, label).
KEY_METRICS: tuple[tuple[str, str], ...] = (
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_tpot_ms", "TPOT p50"),
    ("median_itl_ms", "ITL p50"),
    ("median_e2el_ms", "E2EL p50"),
    ("output_throughput", "Output throughput"),
    ("request_throughput", "Request throughput"),
    ("prefix_cache_hit_rate", "Prefix cache hit rate"),
)
DEFAULT_METRIC = "median_ttft_ms"
#: Bootstrap draws per comparison by number of comparisons: (up to this many, draws).
N_BOOT_STEPS: tuple[tuple[int, int], ...] = ((10, 2000), (50, 1000), (100, 500), (MAX_RUNS, 200))
FULL_N_BOOT = N_BOOT_STEPS[0][1]
#: Top-level configuration fields compared, in column order (then the nested groups).
TOP_FIELDS = (
    "model_id",
    "model_digest",
    "max_model_len",
    "seed",
    "vllm_version",
    "request_list_hash",
)
NESTED = ("engine_args", "layout", "workload")

_ID_SPLIT = re.compile(r"[\s,;]+")
_CACHE_SIZE = 16
_cache = PageCache(_CACHE_SIZE)


# --------------------------------------------------------------------------- selection


def parse_ids(values: Sequence[str]) -> tuple[list[str], int]:
    """``run`` parameter values -> (run ids in first-seen order, duplicates dropped).

    A value may hold several ids separated by whitespace, commas or semicolons.
    """
    ids: list[str] = []
    seen: set[str] = set()
    dropped = 0
    for raw in values:
        for token in _ID_SPLIT.split(raw.strip()):
            if not token:
                continue
            if token in seen:
                dropped += 1
                continue
            seen.add(token)
            ids.append(token)
    return ids, dropped


def n_boot_for(comparisons: int) -> int:
    """Bootstrap draws per comparison for ``comparisons`` runs vs the reference.

    2000 draws (the experiment page's default) for up to 10 comparisons, then
    1000 / 500 / 200: one comparison on the demo data (16 requests per run) costs
    about 30 / 15 / 8 / 5 ms at 2000 / 1000 / 500 / 200 draws
    (``scripts/bench_compare_page.py``).
    """
    for limit, draws in N_BOOT_STEPS:
        if comparisons <= limit:
            return draws
    return N_BOOT_STEPS[-1][1]


# --------------------------------------------------------------------------- settings


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping) and value:
        for k in sorted(value, key=str):
            _flatten(f"{prefix}.{k}", value[k], out)
    else:
        out[prefix] = value


def flatten_settings(run: Run, experiment_name: str) -> dict[str, Any]:
    """The run's configuration as ``{dotted key: value}``.

    Keys: ``experiment`` (its name), :data:`TOP_FIELDS`, ``engine_args.*`` (the
    resolved engine arguments with the explicit ones on top), ``layout.*`` and
    ``workload.*``; nested dicts become ``a.b.c`` keys, lists stay values.
    """
    out: dict[str, Any] = {"experiment": experiment_name}
    for name in TOP_FIELDS:
        out[name] = getattr(run, name)
    groups = {
        "engine_args": {**(run.engine_args or {}), **(run.explicit_engine_args or {})},
        "layout": run.layout or {},
        "workload": run.workload or {},
    }
    for group in NESTED:
        for k in sorted(groups[group], key=str):
            _flatten(f"{group}.{k}", groups[group][k], out)
    return out


_MISSING = object()


def _canon(value: Any) -> Any:
    """A hashable key equal for equal settings: ``1`` == ``1.0``, ``true`` != ``1``.

    Scalars compare by value (tagged by kind), anything else by canonical JSON.
    """
    if value is _MISSING:
        return ("absent",)
    if value is None:
        return ("null",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int | float):
        return ("num", value)
    if isinstance(value, str):
        return ("str", value)
    return ("json", json.dumps(value, sort_keys=True, default=str))


def settings_diff(
    flats: Sequence[Mapping[str, Any]],
) -> tuple[list[str], list[tuple[str, Any]]]:
    """Split the union of keys of ``flats`` into (differing keys, identical (key, value)).

    A key is identical when every run has it with equal values (numbers by value,
    so ``1`` == ``1.0``; a bool never equals a number; lists and dicts as
    canonical JSON); a key some runs lack differs. Both lists keep
    :func:`flatten_settings` order (first seen).
    """
    keys: dict[str, None] = {}
    for flat in flats:
        keys.update(dict.fromkeys(flat))
    differing: list[str] = []
    identical: list[tuple[str, Any]] = []
    for key in keys:
        first = _canon(flats[0].get(key, _MISSING))
        if first != ("absent",) and all(
            _canon(flat.get(key, _MISSING)) == first for flat in flats[1:]
        ):
            identical.append((key, flats[0][key]))
        else:
            differing.append(key)
    return differing, identical


def setting_text(value: Any) -> str:
    """A setting value as shown in a cell: JSON text (``true``, ``64``, ``"fp8"``)."""
    return json.dumps(value, sort_keys=True, default=str)


# --------------------------------------------------------------------------- formatting


def _digits(v: float) -> int:
    a = abs(v)
    return 0 if a >= 1000 else 1 if a >= 10 else 2 if a >= 1 else 3


def fmt_value(value: float | None, unit: str) -> str:
    """A metric value in its unit (fractions as %); ``–`` when missing."""
    if value is None:
        return "–"
    if unit == "fraction":
        return f"{value * 100:.1f} %"
    return f"{value:,.{_digits(value)}f}"


def fmt_delta(cell: Cell, unit: str) -> str:
    """``×0.13 [0.12, 0.14]`` (ratio and CI) or ``+42.0 pp [40.1, 44.0]`` (difference)."""
    if cell.ratio is not None and cell.ci_of != "difference":
        text = f"×{cell.ratio:.2f}"
        if cell.ci_of == "ratio" and cell.ci_low is not None and cell.ci_high is not None:
            text += f" [{cell.ci_low:.2f}, {cell.ci_high:.2f}]"
        return text
    if cell.difference is None:
        return ""
    scale, suffix = (100.0, " pp") if unit == "fraction" else (1.0, f" {unit}")
    text = f"{cell.difference * scale:+.1f}{suffix}"
    if cell.ci_of == "difference" and cell.ci_low is not None and cell.ci_high is not None:
        text += f" [{cell.ci_low * scale:+.1f}, {cell.ci_high * scale:+.1f}]"
    return text


def _r(x: float | None) -> float | None:
    """``x`` to 8 significant digits (keeps the page small; far below any CI width)."""
    return None if x is None else float(f"{x:.8g}")


def cell_attrs(cell: Cell) -> Markup:
    """``data-verdict`` and, for point ratios without interval, ``data-source="point"``.

    The numbers themselves are in the page's JSON (``#compare-data``), not repeated here.
    """
    parts = []
    if cell.verdict:
        parts.append(f' data-verdict="{escape(cell.verdict)}"')
    if cell.source == "point":
        parts.append(' data-source="point"')
    return Markup("".join(parts))


def _heading(name: str, label: str) -> str:
    unit = METRICS_BY_NAME[name].unit
    return f"{label} ({'%' if unit == 'fraction' else unit})"


# --------------------------------------------------------------------------- page


@dataclass
class _Selection:
    ids: list[str]
    duplicates: int = 0
    ref: str | None = None
    metric: str = DEFAULT_METRIC
    errors: list[str] = field(default_factory=list)


def _selection(pairs: Sequence[tuple[str, str]]) -> _Selection:
    ids, dupes = parse_ids([v for k, v in pairs if k == "run"])
    params = {k: v.strip() for k, v in pairs if k != "run"}
    metric = params.get("metric") or DEFAULT_METRIC
    if metric not in dict(KEY_METRICS):
        metric = DEFAULT_METRIC
    return _Selection(ids=ids, duplicates=dupes, ref=params.get("ref") or None, metric=metric)


def _load(session: Session, ids: list[str]) -> list[tuple[Run, str, int]]:
    """(run, experiment name, experiment repeats) of ``ids``, in ``ids`` order (unknown
    left out)."""
    return RunRepository(session).with_experiments(ids)


def _cached_compare(
    session: Session, runs: list[Run], ref: int, n_boot: int
) -> tuple[list[dict[str, Cell]], bool]:
    """:func:`orchestrator.analysis.service.compare_stored_runs` of ``runs`` on
    :data:`KEY_METRICS`, cached while every run is terminal; (cells, cache hit).

    On a hit nothing more is read from the database (the request records are the
    bulk of the reads).
    """
    key = (tuple((r.id, r.status) for r in runs), ref, n_boot)
    cacheable = not any(r.status in ACTIVE for r in runs)
    if cacheable:
        hit: list[dict[str, Cell]] | None = _cache.get(key)
        if hit is not None:
            return hit, True
    cells = compare_stored_runs(session, runs, ref, n_boot, [name for name, _ in KEY_METRICS])
    if cacheable:
        _cache.put(key, cells)
    return cells, False


def clear_cache() -> None:
    """Forget cached comparisons (benchmarks time the uncached page)."""
    _cache.clear()


def run_label(run: Run, experiment: str, repeats: int, many_experiments: bool) -> str:
    """``apc-on (repeat 2)``; ``bulk-00003 · v1`` when the runs span several experiments.

    The repeat is 1-based and shown when the experiment has several repeats.
    """
    base = run.name
    if repeats > 1 or run.repeat_index > 0:
        base += f" (repeat {run.repeat_index + 1})"
    return f"{experiment} · {base}" if many_experiments else base


def build_context(session: Session, sel: _Selection) -> tuple[dict[str, Any], int]:
    """The template context and HTTP status for a selection."""
    started = time.perf_counter()
    ctx: dict[str, Any] = {
        "nav": "compare",
        "ids": sel.ids,
        "duplicates": sel.duplicates,
        "max_runs": MAX_RUNS,
        "errors": [],
        "runs": [],
        "metric": sel.metric,
        "key_metrics": [(n, label, _heading(n, label)) for n, label in KEY_METRICS],
        "post_above": POST_ABOVE,
    }
    if len(sel.ids) > MAX_RUNS:
        ctx["errors"].append(
            f"{len(sel.ids)} runs selected: the compare page takes at most {MAX_RUNS}. "
            "Narrow the selection (filter the run history by experiment, model or status)."
        )
        return ctx, 422
    loaded = _load(session, sel.ids) if sel.ids else []
    if _refused(ctx, sel, {run.id for run, _, _ in loaded}):
        return ctx, 422
    if len(loaded) < 2:
        if loaded:
            run, name, repeats = loaded[0]
            ctx["single"] = {"run": run, "label": run_label(run, name, repeats, True)}
        return ctx, 200

    runs = [run for run, _, _ in loaded]
    experiments = {run.experiment_id: name for run, name, _ in loaded}
    many = len(experiments) > 1
    ref, ref_note = _reference(sel, runs)
    comparisons = sum(1 for i, r in enumerate(runs) if i != ref and r.status == "succeeded")
    n_boot = n_boot_for(comparisons)
    cells, cached = _cached_compare(session, runs, ref, n_boot)

    flats = [flatten_settings(run, name) for run, name, _ in loaded]
    differing, identical = settings_diff(flats)
    ref_run = runs[ref]
    rows = _rows(loaded, flats, differing, ref, cells, many)
    chart = _chart(cells, ref, sel.metric, n_boot, rows)
    statuses: dict[str, int] = {}
    for run in runs:
        statuses[run.status] = statuses.get(run.status, 0) + 1
    ctx.update(
        {
            "runs": rows,
            "ref": ref,
            "ref_run": ref_run,
            "ref_label": rows[ref]["label"],
            "ref_note": ref_note,
            "ref_ok": ref_run.status == "succeeded",
            "differing": differing,
            "identical": identical,
            "n_boot": n_boot,
            "full_n_boot": FULL_N_BOOT,
            "comparisons": comparisons,
            "statuses": statuses,
            "single_experiment": None if many else next(iter(experiments)),
            "active": [r.id for r in runs if r.status in ACTIVE],
            "chart": chart,
            "cached": cached,
            "fmt_value": fmt_value,
            "fmt_delta": fmt_delta,
            "cell_attrs": cell_attrs,
            "units": {n: METRICS_BY_NAME[n].unit for n, _ in KEY_METRICS},
            "setting_text": setting_text,
        }
    )
    ctx["elapsed_ms"] = (time.perf_counter() - started) * 1000
    return ctx, 200


def _refused(ctx: dict[str, Any], sel: _Selection, known: set[str]) -> bool:
    """Whether the selection names an unknown run or a reference outside it (the error
    goes into ``ctx``)."""
    unknown = [i for i in sel.ids if i not in known]
    if unknown:
        shown = ", ".join(unknown[:20]) + (
            f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
        )
        ctx["errors"].append(f"Unknown run id{'s' if len(unknown) > 1 else ''}: {shown}")
        ctx["unknown"] = unknown
        return True
    if sel.ref is not None and sel.ref not in known:
        ctx["errors"].append(f"Reference run {sel.ref} is not among the compared runs.")
        return True
    return False


def _reference(sel: _Selection, runs: Sequence[Run]) -> tuple[int, str | None]:
    """The reference's index (the chosen run, else the first that succeeded) and a note
    when it is not the first selected run for that reason."""
    if sel.ref is not None:
        return sel.ids.index(sel.ref), None
    ref = next((i for i, r in enumerate(runs) if r.status == "succeeded"), 0)
    if ref == 0:
        return ref, None
    return ref, (
        f"the first selected run did not succeed ({runs[0].status}); the reference "
        f"is the first one that did"
    )


def _rows(
    loaded: Sequence[tuple[Run, str, int]],
    flats: Sequence[dict[str, Any]],
    differing: Sequence[str],
    ref: int,
    cells: Sequence[dict[str, Cell]],
    many: bool,
) -> list[dict[str, Any]]:
    """One table row per run: its label, the settings that differ (and whether each differs
    from the reference's) and its metric cells."""
    ref_flat = flats[ref]
    rows: list[dict[str, Any]] = []
    for i, ((run, exp_name, repeats), flat) in enumerate(zip(loaded, flats, strict=True)):
        rows.append(
            {
                "index": i + 1,
                "run": run,
                "experiment": exp_name,
                "label": run_label(run, exp_name, repeats, many),
                "is_ref": i == ref,
                "settings": [
                    (
                        setting_text(flat[k]) if k in flat else None,
                        _canon(flat.get(k, _MISSING)) != _canon(ref_flat.get(k, _MISSING)),
                    )
                    for k in differing
                ],
                "cells": cells[i],
            }
        )

    return rows


def _chart_point(c: Cell, base: float | None) -> dict[str, Any]:
    """One run's value of one metric for the chart, None fields left out."""
    interval = c.value_interval(base)
    point = {
        "v": _r(c.value),
        "lo": _r(interval[0]) if interval else None,
        "hi": _r(interval[1]) if interval else None,
        "ratio": _r(c.ratio),
        "difference": _r(c.difference) if c.ratio is None or c.ci_of == "difference" else None,
        "ci_low": _r(c.ci_low),
        "ci_high": _r(c.ci_high),
        "ci_of": c.ci_of,
        "verdict": c.verdict,
        "untrusted_reason": c.untrusted_reason,
    }
    return {k: v for k, v in point.items() if v is not None}


def _chart(
    cells: Sequence[dict[str, Cell]],
    ref: int,
    metric: str,
    n_boot: int,
    rows: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """The chart's data: each key metric's value per run, against the reference."""
    chart_values: dict[str, list[dict[str, Any] | None]] = {}
    ref_cells = cells[ref]
    for name, _ in KEY_METRICS:
        series: list[dict[str, Any] | None] = []
        base = ref_cells[name].value if name in ref_cells else None
        for row_cells in cells:
            c = row_cells.get(name)
            if c is None or c.value is None:
                series.append(None)
                continue
            series.append(_chart_point(c, base))
        chart_values[name] = series
    chart = {
        "reference": ref,
        "metric": metric,
        "n_boot": n_boot,
        "metrics": [
            {
                "name": n,
                "label": label,
                "unit": METRICS_BY_NAME[n].unit,
                "direction": METRICS_BY_NAME[n].direction,
            }
            for n, label in KEY_METRICS
        ],
        "runs": [{"id": r["run"].id, "label": r["label"], "status": r["run"].status} for r in rows],
        "values": chart_values,
    }
    return chart


def _page(request: Request, session: Session, pairs: Sequence[tuple[str, str]]) -> HTMLResponse:
    sel = _selection(pairs)
    ctx, status = build_context(session, sel)
    return render(request, "compare.html", ctx, status)


@router.get("/compare", response_class=HTMLResponse)
def compare(request: Request, session: SessionDep) -> HTMLResponse:
    """The compare page for ``?run=<id>&run=<id>...[&ref=<id>][&metric=<name>]``."""
    return _page(request, session, list(request.query_params.multi_items()))


@router.post("/compare", response_class=HTMLResponse)
async def compare_posted(request: Request, session: SessionDep) -> HTMLResponse:
    """The compare page for a form-encoded body with the same fields (large selections)."""
    body = (await request.body()).decode("utf-8", errors="replace")
    pairs = parse_qsl(body, keep_blank_values=False)
    return await run_in_threadpool(_page, request, session, pairs)
