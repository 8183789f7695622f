"""Ending a run whose supervisor is gone: failed, keeping what it measured.

Used by the poll loop (a batch whose poll is done without a result for a run: its
supervisor died or stopped answering) and by the reconcile loop (a run of a dead
orchestrator, or one whose heartbeat went stale, that cannot be re-attached).

What a lost run measured survives it: its request records and ``/metrics`` samples
were streamed to the database while it ran, those that had not reached it yet are
read back from the run's journal beside its engine log (:mod:`jobs.run.journal`),
its summary metrics are computed from the records, and its engine log is read from
disk.
"""

from __future__ import annotations

import logging
from typing import Any

from jobs.load import loadgen
from jobs.schemas import RequestRecord
from orchestrator.core.models import Run, RunRequest
from orchestrator.core.repositories import RunRepository
from orchestrator.core.states import RunStatus
from orchestrator.runs.logs import engine_log_from_disk, journal_from_disk

log = logging.getLogger(__name__)


def fail_lost(repo: RunRepository, run: Run, reason: str) -> None:
    """End a run whose supervisor is gone: failed, keeping what it measured.

    Its request records and samples streamed so far stay, and those its journal on
    this machine's disk holds beyond them are added (:func:`recover_journal`); the
    metrics of its measured records are computed from them (the measured phase
    spanning the first start to the last end); ``partial`` when any succeeded; its
    engine log is read from disk.
    """
    journal = recover_journal(repo, run)
    records = [_record(r) for r in repo.request_rows(run.id)]
    measured = [r for r in records if not r.warmup]
    ok = sum(1 for r in measured if r.success)
    metrics: dict[str, float] = {}
    if measured:
        begin = min(r.start_s for r in measured)
        end = max(r.start_s + (r.e2el_s or 0.0) for r in measured)
        if end > begin:
            metrics = loadgen.summarize(measured, end - begin)
    repo.save_recovered(run.id, metrics=metrics, engine_log=engine_log_from_disk(run) or "")
    planned = int((run.progress or {}).get("requests_total") or 0)
    run.progress = {
        **(run.progress or {}),
        "phase": "done",
        "message": "failed",
        "requests_done": len(measured),
        "requests_total": max(planned, len(measured)),
    }
    run.partial = ok > 0
    kept = (
        f"; the {len(measured)} measured requests it had recorded ({ok} succeeded) are kept"
        if measured
        else "; it had recorded no measured request"
    )
    run.engine_info = {
        **(run.engine_info or {}),
        "recovered": {
            "requests": len(records),
            "measured": len(measured),
            "succeeded": ok,
            "samples": repo.count_samples(run.id),
            "journal": journal,
        },
        **({"partial": True} if ok else {}),
    }
    repo.transition(run, RunStatus.FAILED, reason)
    run.error = reason + kept


def _record(r: RunRequest) -> RequestRecord:
    """A stored request row as the load generator's record."""
    return RequestRecord(
        index=r.request_index,
        warmup=r.warmup,
        request_class=r.request_class,
        success=r.success,
        error=r.error,
        start_s=r.start_s,
        ttft_s=r.ttft_s,
        itl_s=list(r.itl_s or []),
        tpot_s=r.tpot_s,
        e2el_s=r.e2el_s,
        prompt_tokens=r.prompt_tokens,
        output_tokens=r.output_tokens,
        cached_tokens=r.cached_tokens,
        scheduled_s=r.scheduled_s,
        conversation=r.conversation,
        turn=r.turn,
    )


def recover_journal(repo: RunRepository, run: Run) -> dict[str, Any]:
    """Add what the run's journal holds and the database does not: request records
    by ``seq`` (the stream's numbering: none twice), samples after the stored ones.
    Returns what was added and the reader's notes (a torn last line...)."""
    found = journal_from_disk(run)
    if found is None:
        return {"read": False, "note": "no engine log path noted for this run"}
    records = repo.insert_requests(run.id, found.records.get(run.id, {}))
    stored = repo.count_samples(run.id)
    samples = found.samples.get(run.id, {})
    later = [samples[seq] for seq in sorted(samples) if seq >= stored]
    repo.append_samples(run.id, later)
    if records or later or found.notes:
        log.info(
            "run %s: %d request records and %d samples recovered from its journal%s",
            run.id,
            records,
            len(later),
            f" ({'; '.join(found.notes)})" if found.notes else "",
        )
    return {"read": True, "records": records, "samples": len(later), "notes": found.notes}
