"""The batches this orchestrator runs, and the poll loop's work on them.

A batch is the runs that share one vLLM server (its id is its first run's id). Once
per turn of the poll loop each batch's backend is asked how it goes
(:meth:`ActiveRuns.poll_one`):

- done: each run's result is recorded (the ``runs`` room), and a run without one (its
  supervisor died, or stopped answering for ``orchestrator.stale_after_s``) fails
  keeping what it measured (:func:`orchestrator.dispatch.lost_runs.fail_lost`); the
  engines no live run owns are swept at once;
- still going, and its supervisor answered: the request records and ``/metrics``
  samples its runs took since the last poll are streamed to the database, the run
  being measured moves ``preparing -> running``, and every run's heartbeat is
  renewed; a cancel request is passed on to the backend;
- still going, supervisor silent: nothing (no heartbeat: the backend bounds the
  silence).

Why stream records rather than recover them from the supervisor: when the service
dies with a local Ray, the supervisor goes with it (and its actor is owned by the
dead driver on any cluster), so only what is already in the database or on disk
survives; one bulk insert per second per running batch is cheap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.db import is_unavailable, unit_of_work
from orchestrator.core.models import Run
from orchestrator.core.repositories import RunRepository
from orchestrator.core.states import RunStatus, is_terminal
from orchestrator.dispatch.lost_runs import fail_lost
from orchestrator.dispatch.run_backend import Poll, RunBackend
from orchestrator.runs.service import record_result

log = logging.getLogger(__name__)

#: ``{run_id: (how many were streamed before, the new rows)}``
Fetched = dict[str, tuple[int, list[dict[str, Any]]]]


@dataclass
class ActiveRuns:
    """The batches this orchestrator holds (launched or adopted) and their stream counts."""

    session_factory: sessionmaker[Session]
    backend: RunBackend
    #: kills the engine processes no live run owns (after a run was failed lost)
    sweep: Callable[[], object]
    #: batch id (its first run's id) -> the run ids of the batch, in order
    active: dict[str, list[str]] = field(default_factory=dict)
    #: run id -> how many of its request records are in the database (streamed so far)
    streamed: dict[str, int] = field(default_factory=dict)
    #: run id -> how many of its ``/metrics`` samples are in the database
    streamed_samples: dict[str, int] = field(default_factory=dict)

    def run_ids(self) -> set[str]:
        """Every run of every batch held."""
        return {rid for ids in self.active.values() for rid in ids}

    def hold(self, run_ids: list[str], records: int = 0, samples: int = 0) -> None:
        """Hold a batch (launched, or adopted with ``records``/``samples`` already stored)."""
        self.active[run_ids[0]] = list(run_ids)
        for rid in run_ids:
            self.streamed[rid], self.streamed_samples[rid] = records, samples

    def poll_all(self) -> None:
        """One turn of the poll loop: every batch held, in the order they were taken."""
        for batch_id in list(self.active):
            self.poll_one(batch_id)

    def poll_one(self, batch_id: str) -> None:
        """Record the batch's results when it is done (a run without one, its supervisor
        lost, ends failed keeping what it measured, and the engines no live run owns are
        swept at once); otherwise, when its supervisor answered, stream what its runs
        measured since the last poll and beat their hearts."""
        poll = self.backend.poll(batch_id)
        if self.record_poll(batch_id, poll):
            try:
                self.sweep()
            except Exception as exc:  # noqa: BLE001 - the reconcile loop sweeps again
                if is_unavailable(exc):
                    raise
                log.exception("sweeping the engines of a lost run failed")

    def record_poll(self, batch_id: str, poll: Poll) -> bool:
        """Write what ``poll`` says of the batch; True when a run of it was failed lost."""
        run_ids = self.active[batch_id]
        with unit_of_work(self.session_factory) as s:
            repo = RunRepository(s)
            runs = [r for rid in run_ids if (r := repo.get(rid, for_update=True)) is not None]
            live = [r for r in runs if not is_terminal(r.status)]
            if not live:
                self._drop(batch_id)
                return False
            if poll.done:
                return self._record_done(s, repo, batch_id, live, poll)
            if any(r.cancel_requested for r in live):
                self.backend.cancel(batch_id)  # the batch's server stops; its runs end cancelled
            if not poll.answered:  # silent: no heartbeat; the backend bounds the silence
                return False
            counted = self._stream_measured(repo, batch_id)
            progress = poll.progress or {}
            current = progress.get("run_id") or run_ids[0]
            for run in live:
                if run.id != current:
                    repo.heartbeat(run.id, None)
                    continue
                measuring = progress.get("phase") in ("warmup", "measuring")
                if run.status == RunStatus.PREPARING.value and measuring:
                    repo.transition(run, RunStatus.RUNNING)
                repo.heartbeat(run.id, progress or None)
        # counted once the rows are committed: a failed commit streams them again
        self.streamed.update(counted[0])
        self.streamed_samples.update(counted[1])
        return False

    def _record_done(
        self, s: Session, repo: RunRepository, batch_id: str, live: list[Run], poll: Poll
    ) -> bool:
        """Record the results of a batch whose poll is done; True when a run had none."""
        lost = False
        results = {res.run_id: res for res in poll.results or []}
        for run in live:
            result = results.get(run.id)
            if result is None:  # its supervisor is gone: keep what was measured
                reason = poll.error or "the run supervisor returned no result for it"
                fail_lost(repo, run, reason)
                log.warning("run %s failed: %s", run.id, reason)
                lost = True
            else:
                record_result(s, run, result)
                log.info("run %s ended %s", run.id, result.status)
            self.streamed.pop(run.id, None)
            self.streamed_samples.pop(run.id, None)
        self._drop(batch_id)
        return lost

    def _drop(self, batch_id: str) -> None:
        self.active.pop(batch_id, None)
        self.backend.release(batch_id)

    def _stream_measured(
        self, repo: RunRepository, batch_id: str
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Write the request records and ``/metrics`` samples the batch's runs took since
        the last poll; returns how many of each (records, samples) each run has then."""
        records = self._fetch("request records", self.backend.records, batch_id, self.streamed)
        samples = self._fetch("samples", self.backend.samples, batch_id, self.streamed_samples)
        for rid, (since, rows) in records.items():
            repo.append_requests(rid, since, rows)
        for rid, (_, rows) in samples.items():
            repo.append_samples(rid, rows)
        return (
            {rid: since + len(rows) for rid, (since, rows) in records.items()},
            {rid: since + len(rows) for rid, (since, rows) in samples.items()},
        )

    def _fetch(
        self,
        what: str,
        fetch: Callable[[str, dict[str, int]], dict[str, list[dict[str, Any]]]],
        batch_id: str,
        streamed: dict[str, int],
    ) -> Fetched:
        """``{run_id: (how many were streamed before, the new ones)}`` of the batch's runs
        (``{}`` when the backend does not answer: streaming is a safety net)."""
        since = {rid: streamed.get(rid, 0) for rid in self.active[batch_id]}
        try:
            new = fetch(batch_id, since)
        except Exception:  # noqa: BLE001 - streaming is a safety net, never a failure
            log.exception("reading the %s of batch %s failed", what, batch_id)
            return {}
        return {rid: (since[rid], rows) for rid, rows in new.items() if rid in since and rows}
