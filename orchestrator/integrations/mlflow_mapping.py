"""What one vlab run becomes in MLflow: params, summary metrics, metric history and tags.

Pure functions over the stored run (:class:`RunHead`), its summary metrics and its
``/metrics`` samples; :mod:`orchestrator.integrations.mlflow_export` sends the result.

- **params**: the resolved engine arguments (``engine_args.<name>``: the run's
  ``engine_args``, what ``vllm serve`` was started with after vLLM's own defaults; not
  the launch-time ones, ``host``, ``port``, ``model`` ..., nor argparse's ``==SUPPRESS==``
  placeholders), the
  requested layout (``layout.<key>``: ``tensor_parallel_size``, ``pipeline_parallel_size``,
  ``devices`` ...), the layout the run got (``placement.nnodes``, ``placement.devices``,
  ``placement.devices_per_node``, ``placement.resource``, ``placement.policy`` ...; absent
  for a run never placed), the workload (``workload.<key>``), the model (``model.id``,
  ``model.digest``, ``model.revision``) and ``max_model_len`` (the context cap it ran with).
  A run of an experiment with a capacity search also gets the search's settings as
  ``capacity.<key>`` (the spec with its defaults filled in: ``capacity.variable``,
  ``capacity.min``, ``capacity.max``, ``capacity.tolerance``, ``capacity.max_steps``, the
  step lengths ``capacity.min_step_s``, ``capacity.max_step_s``, ``capacity.warmup_fraction``
  ..., every objective as ``capacity.slos.<metric>.<percentile>``), and an experiment with
  goodput SLOs gets them as ``slos.<metric>`` (:func:`capacity_params`).
  Values: :func:`param_value`. A value over MLflow's 6,000 characters is cut, ends with
  ``…[truncated from N chars]`` and its key is listed in the tag ``vlab.truncated_params``.
  Keys keep MLflow's character set (:func:`mlflow_key`).
- **metrics**: the run's summary metrics (``median_ttft_ms``, ``p99_itl_ms``,
  ``output_throughput``, ``request_goodput``, ``prefix_cache_hit_rate`` ...), finite numbers
  only. A number that is not known is never written (never as 0): every compared metric
  (:data:`orchestrator.analysis.compare.METRICS`) the run lacks, and every stored value that
  is not finite, is named in the tag ``vlab.unknown_metrics``. A run that did not succeed
  gets no summary metrics (its numbers are no valid measurement; the tag
  ``vlab.metrics_withheld`` says so).
- **capacity** (a run with a capacity search: :func:`capacity_metrics`,
  :func:`capacity_tags`): the summary's ``capacity``, ``capacity_low``, ``capacity_high``
  exist only when the search found the boundary, so the evidence of every search is
  written too: ``capacity_lower_bound`` and
  ``capacity_upper_bound``, the interval the capacity lies in (found: the capacity and the
  lowest failing load; ``at_least_max`` and ``client_limited``: a lower bound only;
  ``below_min``: an upper bound only; ``uncertain``, ``steps_exhausted``: the bracket so
  far; an end no step showed is absent, never 0), ``capacity_client_ceiling`` when
  measured, and the tags ``vlab.capacity_status``, ``vlab.capacity_bound`` (in words:
  ``at least 8 req/s``, ``below 1 req/s`` ...), ``vlab.capacity_variable``,
  ``vlab.capacity_binding_slo``, ``vlab.capacity_note``, ``vlab.capacity_steps``. A
  succeeded search run without a found capacity names ``capacity`` in
  ``vlab.unknown_metrics``. Metrics only for a succeeded run, as the summary's.
- **metric history**: every stored ``/metrics`` sample (keys of
  :data:`jobs.signals.enginemetrics.SAMPLE_KEYS`) as ``series/<key>`` (``series/kv_cache_usage``,
  ``series/num_requests_waiting`` ...) with step = the sample's ``t_s`` in milliseconds
  (since the run's segment began: for the first run of a server that includes the server's
  start-up). vlab records no wall-clock time per sample, so the exporter's timestamp is the
  same offset (milliseconds after the Unix epoch: relative time exact, the wall time
  visibly not one) and the tag ``vlab.series_clock`` says so. Non-finite points are left
  out (counted in ``vlab.series_skipped_points``).
- **tags**: ``vlab.experiment_id``, ``vlab.experiment_name``, ``vlab.run_id``,
  ``vlab.variant``, ``vlab.repeat`` (the repeat's number from 1, as the dashboard shows it
  and the MLflow run's name ``<variant> #<repeat>`` has it), ``vlab.repeat_index`` (the
  stored index, from 0), ``vlab.sequence``, ``vlab.is_baseline``,
  ``vlab.variable`` (the changed variable), ``vlab.changes``, ``vlab.reference_variant``,
  ``vlab.request_list_hash``, ``vlab.status`` (and ``vlab.status_reason``, ``vlab.error``,
  ``vlab.partial``), ``vlab.vllm_version``, ``vlab.model_id``, ``vlab.run_url`` (when the
  service's address is known); values over MLflow's 8,000 characters are cut.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from jobs.capacity.search import CapacitySpec
from jobs.engine.command import RESERVED_ENGINE_ARGS
from orchestrator.analysis.capacity_compare import Evidence, repeat_evidence
from orchestrator.analysis.compare import METRICS
from orchestrator.core.models import Run
from orchestrator.runs.timeseries import Point

__all__ = [
    "EXPECTED_METRICS",
    "MLFLOW_STATUS",
    "RunHead",
    "capacity_metrics",
    "capacity_params",
    "capacity_tags",
    "epoch_ms",
    "mlflow_key",
    "param_value",
    "run_metrics",
    "run_params",
    "run_tags",
    "series_metrics",
    "summary_metrics",
]

# MLflow's limits (mlflow/utils/validation.py of mlflow-skinny 3.17: MAX_PARAM_VAL_LENGTH,
# MAX_TAG_VAL_LENGTH, MAX_ENTITY_KEY_LENGTH).
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
MAX_KEY = 250

SERIES_PREFIX = "series/"
SERIES_CLOCK = (
    "step and timestamp are milliseconds since the run's segment began (t_s); vlab records "
    "no wall-clock time per sample"
)
WITHHELD = "the run did not succeed: its numbers are no valid measurement"
#: The MLflow run status of each terminal vlab status.
MLFLOW_STATUS = {
    "succeeded": "FINISHED",
    "failed": "FAILED",
    "blocked": "FAILED",
    "cancelled": "KILLED",
}
#: Compared metrics: absent or not finite on a succeeded run -> named in ``vlab.unknown_metrics``.
EXPECTED_METRICS = tuple(m.name for m in METRICS)


_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")


def mlflow_key(name: str) -> str:
    """``name`` as an MLflow param or metric key: characters other than letters, digits,
    ``_ - . / :`` and space become ``_``; empty, ``.`` and ``..`` path segments are dropped
    or replaced (MLflow refuses a key that a path normalisation changes); at most 250
    characters (``validate_param_and_metric_name`` and ``path_not_unique`` of
    ``mlflow/utils/validation.py``)."""
    parts = [
        "_" if seg in (".", "..") else seg
        for seg in _BAD_KEY_CHARS.sub("_", name).split("/")
        if seg
    ]
    return "/".join(parts)[:MAX_KEY] or "_"


def param_value(value: Any) -> str:
    """A string as it is, anything else as JSON (``true``, ``null``, ``2048``, ``[2, 2]``)."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def cut_text(text: str, limit: int) -> tuple[str, bool]:
    """``(text, False)`` when it fits in ``limit`` characters, else its start with a
    ``…[truncated from N chars]`` mark, exactly ``limit`` characters long, and True."""
    if len(text) <= limit:
        return text, False
    mark = f"…[truncated from {len(text)} chars]"
    return text[: limit - len(mark)] + mark, True


@dataclass(frozen=True)
class RunHead:
    """The stored fields of a run the export needs (read before the connection goes back)."""

    id: str
    name: str
    repeat_index: int
    sequence: int
    status: str
    status_reason: str | None
    error: str | None
    partial: bool
    is_baseline: bool
    variable: str | None
    reference_variant: str | None
    changes: dict[str, Any]
    request_list_hash: str
    vllm_version: str | None
    model_id: str
    model_digest: str
    model_revision: str | None
    max_model_len: int | None
    engine_args: dict[str, Any]
    layout: dict[str, Any]
    workload: dict[str, Any]
    placement: dict[str, Any] | None
    created_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    #: the experiment's capacity search and goodput SLOs as submitted (spec ``capacity``,
    #: ``slos``), and the run's search result (``runs.capacity``); None: none
    capacity_spec: dict[str, Any] | None = None
    slos: dict[str, Any] | None = None
    capacity: dict[str, Any] | None = None

    @property
    def repeat(self) -> int:
        """The repeat's number as people see it (the dashboard's ``#1``, ``#2`` ...)."""
        return self.repeat_index + 1

    @classmethod
    def of(cls, run: Run) -> RunHead:
        spec = (run.experiment.spec if run.experiment is not None else None) or {}
        return cls(
            id=run.id,
            name=run.name,
            repeat_index=run.repeat_index,
            sequence=run.sequence,
            status=run.status,
            status_reason=run.status_reason,
            error=run.error,
            partial=bool(run.partial),
            is_baseline=bool(run.is_baseline),
            variable=run.variable,
            reference_variant=run.reference_variant,
            changes=dict(run.changes or {}),
            request_list_hash=run.request_list_hash,
            vllm_version=run.vllm_version,
            model_id=run.model_id,
            model_digest=run.model_digest,
            model_revision=run.model_revision,
            max_model_len=run.max_model_len,
            engine_args=dict(run.engine_args or {}),
            layout=dict(run.layout or {}),
            workload=dict(run.workload or {}),
            placement=dict(run.placement) if run.placement else None,
            created_at=run.created_at,
            started_at=run.started_at,
            finished_at=run.finished_at,
            capacity_spec=spec.get("capacity") or None,
            slos=spec.get("slos") or None,
            capacity=dict(run.capacity) if run.capacity else None,
        )


def placement_params(placement: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    """What the run got (``runs.placement``): node count, device kind, policy, and the
    devices per node when every node says how many."""
    if not placement:
        return []
    out = [
        (f"placement.{key}", placement[key])
        for key in (
            "nnodes",
            "resource",
            "policy",
            "exclusive",
            "tensor_parallel_size",
            "pipeline_parallel_size",
        )
        if key in placement
    ]
    nodes = placement.get("nodes")
    if isinstance(nodes, list) and nodes:
        devices = [n.get("devices") if isinstance(n, dict) else None for n in nodes]
        if all(isinstance(d, int) and not isinstance(d, bool) for d in devices):
            out += [("placement.devices", sum(devices)), ("placement.devices_per_node", devices)]
    return out


def run_params(head: RunHead) -> tuple[dict[str, str], list[str]]:
    """The MLflow params of a run (see the module docstring) and the keys whose value was
    cut to MLflow's 6,000 characters. Keys sanitised by :func:`mlflow_key`; two names that
    sanitise alike keep the first, the later get ``_2``, ``_3`` ..."""
    raw: list[tuple[str, Any]] = [
        (f"engine_args.{k}", v)
        for k, v in head.engine_args.items()
        # launch-time arguments (host, port, model name...: their resolved defaults are not
        # what the engine got) and argparse's SUPPRESS sentinel (no value at all)
        if k not in RESERVED_ENGINE_ARGS and v != argparse.SUPPRESS
    ]
    raw += [(f"layout.{k}", v) for k, v in head.layout.items()]
    raw += placement_params(head.placement)
    raw += [(f"workload.{k}", v) for k, v in head.workload.items()]
    raw += [("model.id", head.model_id), ("model.digest", head.model_digest)]
    if head.model_revision:
        raw.append(("model.revision", head.model_revision))
    if head.max_model_len is not None:
        raw.append(("max_model_len", head.max_model_len))
    raw += capacity_params(head.capacity_spec, head.slos)
    params: dict[str, str] = {}
    truncated: list[str] = []
    for name, value in raw:
        key = base = mlflow_key(name)
        n = 2
        while key in params:
            key = f"{base[: MAX_KEY - 4]}_{n}"
            n += 1
        params[key], was_cut = cut_text(param_value(value), MAX_PARAM_VALUE)
        if was_cut:
            truncated.append(key)
    return params, truncated


def _flat(prefix: str, doc: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``doc``'s leaves as ``(prefix.key.subkey, value)``; a None leaf is left out."""
    out: list[tuple[str, Any]] = []
    for key, value in doc.items():
        if isinstance(value, Mapping):
            out += _flat(f"{prefix}.{key}", value)
        elif value is not None:
            out.append((f"{prefix}.{key}", value))
    return out


def capacity_params(
    spec: Mapping[str, Any] | None, slos: Mapping[str, Any] | None
) -> list[tuple[str, Any]]:
    """The capacity search's settings as ``capacity.<key>`` params (the spec read as
    :class:`jobs.capacity.search.CapacitySpec`, so defaults it ran with are named too;
    a document it no longer takes is written as stored), objectives as
    ``capacity.slos.<metric>.<percentile>``; the goodput SLOs as ``slos.<metric>``."""
    out: list[tuple[str, Any]] = []
    if spec:
        try:
            full = CapacitySpec.model_validate(dict(spec)).model_dump(mode="json")
        except ValueError:  # an older or foreign document: what was stored
            full = dict(spec)
        out += _flat("capacity", full)
    if slos:
        out += _flat("slos", slos)
    return out


#: The unit of each capacity search variable.
CAPACITY_UNITS = {"request_rate": "req/s", "concurrency": "requests in flight"}


def _bound_words(status: str, ev: Evidence | str, unit: str) -> str:
    """The search's result in words: ``found 2.1 req/s (bracket 2.1 to 2.2)``, ``at least
    8 req/s``, ``below 1 req/s``, ``between 1 and 8 req/s``, or why it shows nothing."""
    if isinstance(ev, str):
        return f"{status}: {ev}"
    lo, hi = ev.lo, ev.hi
    if ev.capacity is not None:
        bracket = f" (bracket {lo:g} to {hi:g})" if lo is not None and hi is not None else ""
        return f"{status}: {ev.capacity:g} {unit}{bracket}"
    if lo is not None and hi is not None:
        return f"{status}: between {lo:g} and {hi:g} {unit}"
    if lo is not None:
        return f"{status}: at least {lo:g} {unit}"
    return f"{status}: below {hi:g} {unit}"


def capacity_tags(head: RunHead) -> dict[str, Any]:
    """The tags of the run's capacity search (module docstring); {} without one."""
    doc = head.capacity
    if not doc:
        return {}
    status = str(doc.get("status") or "unknown")
    variable = doc.get("variable")
    unit = CAPACITY_UNITS.get(str(variable), "(unknown unit)")
    return {
        "vlab.capacity_status": status,
        "vlab.capacity_bound": _bound_words(status, repeat_evidence(doc), unit),
        "vlab.capacity_variable": variable,
        "vlab.capacity_binding_slo": doc.get("binding_slo"),
        "vlab.capacity_note": doc.get("note"),
        "vlab.capacity_steps": len(doc.get("steps") or []),
    }


def capacity_metrics(
    head: RunHead, written: Mapping[str, float]
) -> tuple[dict[str, float], list[str]]:
    """``(metrics, unknown metric names)`` of the run's capacity search (module
    docstring): the bounds it measured, its load generator's ceiling; none for a run
    without a search or that did not succeed. ``written``: the summary metrics the run
    writes (a succeeded search run without ``capacity`` there names it unknown)."""
    doc = head.capacity
    if not doc or head.status != "succeeded":
        return {}, []
    metrics: dict[str, float] = {}
    ev = repeat_evidence(doc)
    if isinstance(ev, Evidence):
        for key, value in (("capacity_lower_bound", ev.lo), ("capacity_upper_bound", ev.hi)):
            if value is not None and math.isfinite(value):
                metrics[key] = float(value)
    ceiling = doc.get("client_ceiling")
    number = isinstance(ceiling, int | float) and not isinstance(ceiling, bool)
    if number and isinstance(ceiling, int | float) and math.isfinite(ceiling) and ceiling > 0:
        metrics["capacity_client_ceiling"] = float(ceiling)
    return metrics, [] if "capacity" in written else ["capacity"]


def run_metrics(head: RunHead, stored: Mapping[str, Any]) -> tuple[dict[str, float], list[str]]:
    """``(metrics to write, unknown metric names)``: :func:`summary_metrics` and
    :func:`capacity_metrics` together."""
    metrics, unknown = summary_metrics(head.status, stored)
    extra, more = capacity_metrics(head, metrics)
    return {**metrics, **extra}, sorted({*unknown, *more})


def summary_metrics(status: str, stored: Mapping[str, Any]) -> tuple[dict[str, float], list[str]]:
    """``(metrics to write, unknown metric names)`` of a run with ``status`` and stored
    summary metrics ``stored``.

    A succeeded run writes every finite stored number; the unknown ones are every compared
    metric (:data:`EXPECTED_METRICS`) it lacks and every stored value that is not a finite
    number (never written as 0). Any other status writes none and names none (the tag
    ``vlab.metrics_withheld`` says why).
    """
    if status != "succeeded":
        return {}, []
    finite: dict[str, float] = {}
    for name, value in stored.items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and math.isfinite(value):
            finite[mlflow_key(name)] = float(value)
    unknown = {mlflow_key(n) for n in stored} - set(finite)
    unknown |= {n for n in EXPECTED_METRICS if n not in finite}
    return finite, sorted(unknown)


def series_metrics(points: Sequence[Point]) -> tuple[list[tuple[str, float, int]], int]:
    """The ``/metrics`` samples as metric history: ``[(series/<key>, value, step ms)]`` in
    sample order, and how many points were left out for not being finite numbers."""
    out: list[tuple[str, float, int]] = []
    skipped = 0
    keys: dict[str, str] = {}
    for p in points:
        step = int(round(float(p.t_s) * 1000))
        for name, value in p.values.items():
            if not (isinstance(value, int | float) and math.isfinite(value)):
                skipped += 1
                continue
            key = keys.get(name)
            if key is None:
                key = keys[name] = mlflow_key(SERIES_PREFIX + name)
            out.append((key, float(value), step))
    return out, skipped


def epoch_ms(t: datetime | None) -> int | None:
    """Milliseconds since the Unix epoch (MLflow's timestamps); a naive time is UTC."""
    if t is None:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return int(t.timestamp() * 1000)


def run_tags(
    head: RunHead,
    experiment_name: str,
    experiment_id: str,
    *,
    unknown: list[str],
    truncated: list[str],
    series_points: int,
    series_skipped: int,
    run_url: str | None,
) -> dict[str, str]:
    """The run's tags (module docstring), values as strings cut to MLflow's 8,000
    characters; a tag whose value is unknown is absent, never empty."""
    tags: dict[str, Any] = {
        "vlab.experiment_id": experiment_id,
        "vlab.experiment_name": experiment_name,
        "vlab.run_id": head.id,
        "vlab.variant": head.name,
        "vlab.repeat": head.repeat,
        "vlab.repeat_index": head.repeat_index,
        "vlab.sequence": head.sequence,
        "vlab.is_baseline": head.is_baseline,
        "vlab.request_list_hash": head.request_list_hash,
        "vlab.status": head.status,
        "vlab.partial": head.partial,
        "vlab.model_id": head.model_id,
        "vlab.series_clock": SERIES_CLOCK,
        "vlab.series_points": series_points,
    }
    optional: dict[str, Any] = {
        "vlab.variable": head.variable,
        "vlab.reference_variant": head.reference_variant,
        "vlab.changes": head.changes or None,
        "vlab.vllm_version": head.vllm_version,
        "vlab.status_reason": head.status_reason,
        "vlab.error": head.error,
        "vlab.unknown_metrics": ", ".join(unknown) or None,
        "vlab.truncated_params": ", ".join(truncated) or None,
        "vlab.series_skipped_points": series_skipped or None,
        "vlab.metrics_withheld": WITHHELD if head.status != "succeeded" else None,
        "vlab.run_url": run_url,
        **capacity_tags(head),
    }
    tags.update({k: v for k, v in optional.items() if v is not None})
    return {k: cut_text(param_value(v), MAX_TAG_VALUE)[0] for k, v in tags.items()}
