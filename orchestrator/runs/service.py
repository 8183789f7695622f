"""Use cases of one run once it exists: cancel it, record its result.

Services take a session and never commit; the caller's unit of work does.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from jobs.load.workload import build_requests
from jobs.modelgen.generator import load_tokenizer
from jobs.schemas import RunResult, WorkloadSpec
from orchestrator.analysis.kvcache import check_against_engine
from orchestrator.analysis.prefix import analyze_prefix, summarize
from orchestrator.cluster.placement import reserved_devices
from orchestrator.core.errors import ConflictError
from orchestrator.core.models import Run
from orchestrator.core.repositories import RunRepository
from orchestrator.core.states import RunStatus, is_terminal
from orchestrator.core.telemetry import observe_engine_startup
from orchestrator.experiments.service import get_run

log = logging.getLogger(__name__)


def request_cancel(session: Session, run_id: str) -> Run:
    """Cancel a run: a queued run ends now; an active one is stopped by its orchestrator."""
    repo = RunRepository(session)
    run = get_run(session, run_id, for_update=True)
    if is_terminal(run.status):
        raise ConflictError(
            f"run {run_id} already ended ({run.status}); nothing to cancel",
            code_hint="run_already_ended",
        )
    if run.status == RunStatus.QUEUED.value:
        repo.transition(run, RunStatus.CANCELLED, "cancelled before it started")
    else:
        run.cancel_requested = True
        session.flush()
    return run


def _kv_cache_check(run: Run, engine_info: dict[str, Any]) -> dict[str, Any]:
    """``{"kv_cache_check": ...}``: the KV cache estimate next to the engine's printed
    figures (:func:`orchestrator.analysis.kvcache.check_against_engine`), or ``{}`` when the
    model's config.json or the engine's figures are not available."""
    facts = engine_info.get("startup_facts") or {}
    try:
        config = json.loads((Path(run.model_path) / "config.json").read_text())
        check = check_against_engine(config, run.engine_args or {}, facts)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.info("run %s: no KV cache check (%s)", run.id, exc)
        return {}
    return {} if check is None else {"kv_cache_check": check}


def _prefix_analysis(run: Run, result: RunResult) -> dict[str, Any]:
    """``{"prefix_analysis": ...}`` for a succeeded run with prefix caching on: the
    prompt-prefix analyser over the run's own request list (rebuilt from its workload,
    as the runner built it), summarised by :func:`orchestrator.analysis.prefix.summarize`;
    ``{"prefix_analysis": {"error": ...}}`` when it cannot be computed, ``{}`` otherwise."""
    if result.status != "succeeded" or not (run.engine_args or {}).get("enable_prefix_caching"):
        return {}
    try:
        spec = WorkloadSpec.model_validate(run.workload)
        requests = build_requests(spec, load_tokenizer(run.model_path))
        block_size = int((run.engine_args or {}).get("block_size") or 16)
        analysis = analyze_prefix(requests, run.model_path, block_size=block_size)
    except Exception as exc:  # the run's result must be stored whatever the analyser does
        log.warning("run %s: prefix analysis failed: %s", run.id, exc)
        return {"prefix_analysis": {"error": f"{type(exc).__name__}: {exc}"[:500]}}
    return {"prefix_analysis": summarize(analysis)}


def capacity_metrics(run: Run, result: RunResult) -> dict[str, float]:
    """The run's metrics with its capacity per device: ``capacity_per_device`` =
    ``capacity`` / the devices the run reserved (:func:`reserved_devices` of its layout),
    next to the runner's ``capacity``, ``capacity_low``, ``capacity_high``, which a run
    has only when its search found the boundary. A run that did not succeed keeps no
    capacity metric (its search was cut short: unknown, never a guess)."""
    metrics = dict(result.metrics)
    if result.status != "succeeded":
        for key in ("capacity", "capacity_low", "capacity_high"):
            metrics.pop(key, None)
    elif "capacity" in metrics:
        metrics["capacity_per_device"] = metrics["capacity"] / reserved_devices(run.layout or {})
    return metrics


#: The supervisor's timings (``RunResult.timings``) of a run from its warm-up on.
_AFTER_START = ("warmup_s", "measure_s", "stop_s")


def record_result(session: Session, run: Run, result: RunResult) -> None:
    """Store a finished run's result and end it, in the caller's transaction.

    A capacity run also stores its search (``runs.capacity``: the
    :class:`jobs.capacity.search.CapacityResult` as JSON, every step included) and
    :func:`capacity_metrics`.
    """
    repo = RunRepository(session)
    repo.save_measurements(
        run.id,
        metrics=capacity_metrics(run, result),
        samples=[s.model_dump() for s in result.samples],
        requests=[r.model_dump() for r in result.requests],
        engine_log=result.engine_log,
    )
    run.engine_info = {
        **result.engine_info,
        **_kv_cache_check(run, result.engine_info),
        **_prefix_analysis(run, result),
    }
    run.timings = result.timings
    # vlab_engine_startup_seconds, vlab_engine_start_failures_total
    observe_engine_startup(result.timings or {}, result.status, result.engine_info)
    run.capacity = None if result.capacity is None else result.capacity.model_dump(mode="json")
    # the final counters are what was measured, not the last heartbeat's (which may
    # predate the last requests or belong to the previous phase)
    measured = sum(1 for r in result.requests if not r.warmup)
    run.progress = {
        **(run.progress or {}),
        "phase": "done",
        "message": result.status,
        "requests_done": measured,
    }
    if result.status == "succeeded":
        run.progress["requests_total"] = measured
    else:  # never "400 of 0": the planned count, or at least what finished
        planned = int(run.progress.get("requests_total") or 0)
        run.progress["requests_total"] = max(planned, measured)
    run.error = result.error
    run.partial = result.partial
    if result.engine_info.get("vllm_version"):
        run.vllm_version = str(result.engine_info["vllm_version"])
    status = RunStatus(result.status)
    if status == RunStatus.SUCCEEDED and run.status == RunStatus.PREPARING.value:
        # no poll saw it measuring (a short run): it started measuring when its warm-up
        # began, by the supervisor's own clock, not now
        repo.transition(run, RunStatus.RUNNING)
        after = sum(float((result.timings or {}).get(k) or 0.0) for k in _AFTER_START)
        if run.started_at is not None and after > 0:
            start = run.started_at - timedelta(seconds=after)
            run.started_at = max(start, run.claimed_at) if run.claimed_at else start
    repo.transition(run, status, result.error if status != RunStatus.SUCCEEDED else None)
