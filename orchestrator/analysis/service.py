"""Experiment comparison and export, read from the database.

Builds :mod:`orchestrator.analysis.compare` inputs from stored runs (succeeded
repeats, their measured requests and summary metrics) and returns JSON-safe
documents for ``GET /api/v1/experiments/{id}/comparison`` and the CSV /
Parquet export; any stored runs side by side (the ``/compare`` page:
:func:`compare_stored_runs`).
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import IO, Any

from sqlalchemy.orm import Session

from orchestrator.analysis.advisor import (
    from_compare,
    gain_without_hits,
    more_devices_slower,
    ordered,
    run_findings,
)
from orchestrator.analysis.capacity_compare import CapacityRepeat, compare_capacity
from orchestrator.analysis.compare import ChangedVariable, RunData, VariantRef, compare_variant
from orchestrator.analysis.export import EXPORT_BATCH, SPOOL_IN_MEMORY, write_export
from orchestrator.analysis.findings import findings
from orchestrator.analysis.side_by_side import Cell, compare_runs
from orchestrator.analysis.trust import (
    burst_fraction,
    not_applicable_of,
    objectives_of_capacity,
    objectives_of_slos,
    trust_of,
)
from orchestrator.cluster.placement import reserved_devices
from orchestrator.core.errors import NotFoundError
from orchestrator.core.models import Experiment, Run
from orchestrator.core.repositories import HistoryRepository, RunRepository
from orchestrator.experiments.service import get_experiment, get_run


def _config_value(run: Run, path: str) -> Any:
    section, _, name = path.partition(".")
    if section == "engine_args":
        return run.explicit_engine_args.get(name, run.engine_args.get(name))
    doc = run.layout if section == "layout" else run.workload
    return doc.get(name)


def _requests_by_run(session: Session, run_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    if not run_ids:
        return out
    for r in RunRepository(session).request_rows_for(run_ids):
        out[r.run_id].append(
            {
                "ttft_s": r.ttft_s,
                "tpot_s": r.tpot_s,
                "e2el_s": r.e2el_s,
                "itl_s": r.itl_s,
                "output_tokens": r.output_tokens,
                "prompt_tokens": r.prompt_tokens,
                "success": r.success,
                "warmup": r.warmup,
                "request_class": r.request_class,
            }
        )
    return out


def _changed(variant: Mapping[str, Any], ref_run: Run, run: Run) -> ChangedVariable:
    """What a variant changes against its reference: each path's value in an example run
    of either (the bare value when there is one path)."""
    paths = list(variant.get("variable_paths") or [])
    ref_vals = {p: _config_value(ref_run, p) for p in paths}
    new_vals = {p: _config_value(run, p) for p in paths}
    single = len(paths) == 1
    return ChangedVariable(
        name=str(variant.get("variable")),
        paths=paths,
        reference_value=ref_vals[paths[0]] if single else ref_vals,
        variant_value=new_vals[paths[0]] if single else new_vals,
    )


def _repeat_notes(ok_ref: int, ok_mine: int, ref: str, name: str) -> list[str]:
    """What the succeeded repeats on either side allow: nothing, or no run-level interval."""
    if not ok_mine or not ok_ref:
        return [
            f"insufficient data: {ok_ref} succeeded run(s) of {ref!r} and {ok_mine} of "
            f"{name!r}; nothing to compare yet"
        ]
    if min(ok_mine, ok_ref) < 2:
        return [
            "one repeat on a side: request-level intervals reflect request-to-request "
            "noise only, not run-to-run drift; run-level metrics have no interval"
        ]
    return []


def comparison(session: Session, experiment_id: str, *, n_boot: int = 2000) -> dict[str, Any]:
    """Each variant against its reference: per metric values, ratio, 95 % CI, verdict.

    Shape: ``{"experiment_id", "repeats", "chain": [{variant, reference,
    variable, paths, reference_value, variant_value, runs, succeeded}],
    "variants": [{"variant", "reference", "variable", "metrics":
    [MetricComparison...], "capacity": CapacityComparison | None}], "findings":
    [Finding...]}``. Only succeeded repeats count; a variant with none on either
    side has an empty metric list. ``capacity`` is null unless the experiment
    measures capacity under SLOs (:func:`has_capacity`); then it is
    :func:`orchestrator.analysis.capacity_compare.compare_capacity` of the variant's and the
    reference's capacity searches (verdict ``unknown`` with a ``reason`` until both
    sides have a found capacity). Methods and sources:
    :mod:`orchestrator.analysis.compare`, :mod:`orchestrator.analysis.capacity_compare`.
    """
    exp: Experiment = get_experiment(session, experiment_id)
    runs = list(exp.runs)
    data = runs_as_data(session, runs)
    capacities = capacity_repeats(runs, data) if has_capacity(exp) else None
    example: dict[str, Run] = {}
    for r in runs:
        example.setdefault(r.name, r)
    chain = []
    refs: dict[str, VariantRef] = {}
    by_variant: dict[str, list[Any]] = {}
    out_variants = []
    for v in exp.variants:
        name, ref = v["name"], v.get("reference")
        mine = data.get(name, [])
        entry: dict[str, Any] = {
            "variant": name,
            "reference": ref,
            "variable": v.get("variable"),
            "paths": v.get("variable_paths", []),
            "runs": len(mine),
            "succeeded": sum(1 for d in mine if d.status == "succeeded"),
        }
        if ref is None or name not in example or ref not in example:
            chain.append(entry)
            continue
        changed = _changed(v, example[ref], example[name])
        entry["reference_value"] = changed.reference_value
        entry["variant_value"] = changed.variant_value
        chain.append(entry)
        refs[name] = VariantRef(variant=name, reference=ref, changed=changed)
        comps = compare_variant(mine, data.get(ref, []), n_boot=n_boot, seed=0)
        by_variant[name] = comps
        ok_mine = sum(1 for d in mine if d.status == "succeeded")
        ok_ref = sum(1 for d in data.get(ref, []) if d.status == "succeeded")
        notes = _repeat_notes(ok_ref, ok_mine, ref, name)
        capacity_doc = None
        if capacities is not None:
            cap = compare_capacity(capacities.get(name, []), capacities.get(ref, []))
            capacity_doc = cap.model_dump(mode="json")
        out_variants.append(
            {
                "variant": name,
                "reference": ref,
                "variable": v.get("variable"),
                "succeeded": {"reference": ok_ref, "variant": ok_mine},
                "notes": notes,
                "metrics": [c.model_dump(mode="json") for c in comps],
                "capacity": capacity_doc,
            }
        )
    found = findings(by_variant, data, refs, n_boot=n_boot, seed=0)
    return {
        "experiment_id": exp.id,
        "repeats": exp.repeats,
        "chain": chain,
        "variants": out_variants,
        "findings": [f.model_dump(mode="json") for f in found],
    }


def compare_stored_runs(
    session: Session, runs: list[Run], ref: int, n_boot: int, metrics: Sequence[str]
) -> list[dict[str, Cell]]:
    """Stored runs side by side: :func:`orchestrator.analysis.side_by_side.compare_runs` of
    ``runs`` (any runs, of any experiments) against ``runs[ref]`` on ``metrics``, one
    ``{metric: Cell}`` per run in ``runs`` order (empty for a run that did not succeed)."""
    by_id = {d.run_id: d for group in runs_as_data(session, runs).values() for d in group}
    return compare_runs([by_id[r.id] for r in runs], ref, n_boot, metrics)


def has_capacity(exp: Experiment) -> bool:
    """Whether the experiment measures capacity under SLOs: its spec has ``capacity``
    (every run searches, the ladder's levels included), or a run stored a capacity search."""
    return bool((exp.spec or {}).get("capacity")) or any(r.capacity is not None for r in exp.runs)


def capacity_repeats(
    runs: list[Run], data: dict[str, list[RunData]]
) -> dict[str, list[CapacityRepeat]]:
    """Stored runs as :class:`CapacityRepeat` (status, ``runs.capacity``, devices reserved,
    why its capacity is not to be trusted: :mod:`orchestrator.analysis.trust` of the run in
    ``data``, :func:`runs_as_data`), by variant name in the order of ``runs``; the
    comparison uses succeeded ones only."""
    by_id = {d.run_id: d for ds in data.values() for d in ds}
    out: dict[str, list[CapacityRepeat]] = defaultdict(list)
    for r in runs:
        doc = r.capacity if isinstance(r.capacity, dict) else None
        known = by_id.get(r.id)
        out[r.name].append(
            CapacityRepeat(
                run_id=r.id,
                status=r.status,
                capacity=r.capacity,
                devices=reserved_devices(r.layout),
                untrusted=(
                    trust_of(known, objectives_of_capacity(doc)).reason("capacity")
                    if known is not None and doc is not None
                    else None
                ),
            )
        )
    return out


def export_file(
    session: Session,
    experiment_id: str,
    fmt: str,
    *,
    batch_size: int = EXPORT_BATCH,
    spool_in_memory: int = SPOOL_IN_MEMORY,
) -> tuple[IO[bytes], int]:
    """The experiment's runs, one row each (config and metrics flattened), as CSV or
    Parquet: a temporary file (at its start) and its size in bytes.

    Streamed: the runs are read ``batch_size`` at a time (a server-side cursor) and
    written batch by batch (:func:`orchestrator.analysis.export.write_export`), the
    file in memory up to ``spool_in_memory`` bytes and on disk beyond, so the memory
    does not grow with the number of runs. Complete when returned: a database error
    comes before the caller sends a byte. The caller closes the file.
    """
    history = HistoryRepository(session)
    if not history.experiment_exists(experiment_id):
        raise NotFoundError(f"no experiment {experiment_id}", code_hint="experiment_not_found")
    out = tempfile.SpooledTemporaryFile(max_size=spool_in_memory)  # noqa: SIM115 (returned)
    try:
        write_export(
            history.export_rows(experiment_id, batch_size),
            fmt,
            out,
            spool_in_memory=spool_in_memory,
        )
        size = out.tell()
        out.seek(0)
    except BaseException:
        out.close()
        raise
    return out, size


def runs_as_data(session: Session, runs: list[Run]) -> dict[str, list[RunData]]:
    """Stored runs as :class:`RunData` (metrics, measured requests of succeeded runs), by name.

    A run with prefix caching off has no prefix cache hit rate (the engine made no
    prefix-cache queries, so none is stored): it is ``not_applicable`` (``"off"``), never
    0, and compares as ``n/a (off)`` with no verdict. ``goodput_objectives``: the
    latencies the experiment's goodput ``slos`` count (what token bursts taint,
    :mod:`orchestrator.analysis.trust`); ``itl_burst_fraction`` is computed from the
    requests when the stored metrics lack it (runs stored before the runner recorded it).

    Returns ``{variant name: [RunData, ...]}`` in the order of ``runs``.
    """
    metrics = RunRepository(session).metrics_for([r.id for r in runs])
    requests = _requests_by_run(session, [r.id for r in runs if r.status == "succeeded"])
    data: dict[str, list[RunData]] = defaultdict(list)
    for r in runs:
        run_metrics = dict(metrics.get(r.id, {}))
        reqs = requests.get(r.id, [])
        if "itl_burst_fraction" not in run_metrics and reqs:
            # runs stored before the runner recorded it: once here, not per comparison
            burst = burst_fraction(reqs)
            if burst is not None:
                run_metrics["itl_burst_fraction"] = burst
        slos = (r.experiment.spec or {}).get("slos")
        data[r.name].append(
            RunData(
                run_id=r.id,
                variant=r.name,
                repeat_index=r.repeat_index,
                status=r.status,
                metrics=run_metrics,
                requests=reqs,
                devices=reserved_devices(r.layout),
                changed=dict(r.changes),
                cache_contamination=((r.engine_info or {}).get("cache_contamination") or {}).get(
                    "status"
                ),
                not_applicable=not_applicable_of(r.engine_args),
                goodput_objectives=sorted(objectives_of_slos(slos)),
            )
        )
    return data


def run_advice(session: Session, run_id: str) -> list[dict[str, Any]]:
    """The advisor's findings for one run (:func:`orchestrator.analysis.advisor.run_findings`),
    JSON-safe, in rollback order. Raises :class:`NotFoundError` for an unknown run."""
    run = get_run(session, run_id)
    return [a.model_dump(mode="json") for a in ordered(_run_advice(session, run))]


def _run_advice(session: Session, run: Run, metrics: dict[str, float] | None = None) -> list[Any]:
    """:func:`orchestrator.analysis.advisor.run_findings` of a stored run; ``metrics``: its summary
    metrics when the caller has read them already."""
    repo = RunRepository(session)
    log_text = None
    if run.status in ("failed", "blocked"):
        content = repo.log(run.id)
        log_text = content[-200_000:] if content else None
    doc = {
        "id": run.id,
        "status": run.status,
        "error": run.error,
        "engine_args": run.engine_args,
        "engine_info": run.engine_info,
    }
    return run_findings(doc, repo.metrics(run.id) if metrics is None else metrics, log_text)


def experiment_advice(
    session: Session, experiment_id: str, comparison_doc: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The advisor's findings for an experiment: every run's, the comparison's
    (bootstrap-backed) and more-devices-slower, in rollback order.

    ``comparison_doc``: :func:`comparison` of the experiment when the caller has it
    already (it is the expensive part)."""
    exp = get_experiment(session, experiment_id)
    runs = sorted(exp.runs, key=lambda r: r.sequence)
    advice = []
    metrics = RunRepository(session).metrics_for([r.id for r in runs])
    for r in runs:
        for a in _run_advice(session, r, metrics.get(r.id, {})):
            a.variant = r.name
            advice.append(a)
    cmp = comparison_doc or comparison(session, experiment_id)
    devices = {r.name: reserved_devices(r.layout) for r in runs}
    advice += more_devices_slower(cmp["variants"], devices)
    advice += gain_without_hits(cmp["variants"])
    advice += from_compare(cmp["findings"])
    return [a.model_dump(mode="json") for a in ordered(advice)]
