"""The dispatcher: claims queued runs, hands them to a run backend, records results.

It owns every state change of an active run. A run backend (the Ray layer in
:mod:`orchestrator.dispatch.ray.backend`) reserves the run's devices and runs a
supervisor that calls :mod:`jobs`; the dispatcher polls it once per tick.

Claiming uses ``SELECT ... FOR UPDATE SKIP LOCKED``, so several orchestrators
can share one database without taking the same run. On start (and
periodically) runs whose heartbeat went stale are reconciled: re-attached when
their supervisor is still alive, otherwise marked failed with the reason.

No orphans, ever. Before it claims anything (:meth:`Dispatcher.startup`):

- the runs of this ``VLAB_HOME``'s earlier orchestrators that died (each holds
  an ``flock`` on ``<home>/orchestrators/<id>.lock`` while it lives, so a
  lock anyone can take is a dead one's, however it died) are reconciled at
  once, without waiting for their heartbeat to go stale;
- a run that cannot be re-attached fails, keeping what it measured: its
  request records and ``/metrics`` samples were written to the database while
  it ran (streamed from the supervisor every tick, not only at the end), those
  that had not reached it yet are read back from the run's journal beside its
  engine log (:mod:`jobs.run.journal`), its summary metrics are computed from the
  records, and its engine log is read from disk;
- every engine process on this machine that this home started (they all
  carry ``VLAB_ENGINE_HOME`` and ``VLAB_RUN_ID``) and that no live run owns is
  killed (:meth:`Dispatcher.sweep_engines`; again at each reconcile).

A run whose supervisor dies while the orchestrator lives (``kill -9`` or an
out-of-memory kill of its Ray worker: the backend's poll is done without a result
for it) ends the same way, at once (:meth:`Dispatcher._fail_lost`). So does one whose
supervisor stops answering (SIGSTOP, a hang): while it is silent its runs get no
heartbeat and nothing is streamed; after ``orchestrator.stale_after_s`` without an
answer the backend ends the supervisor and its poll is done without a result.

Why stream records rather than recover them from the supervisor: when the
service dies with a local Ray, the supervisor goes with it (and its actor is
owned by the dead driver on any cluster), so only what is already in the
database or on disk survives; one bulk insert per second per running batch is
cheap. The journal covers the last tick before a death, and a run whose first
node is another machine keeps what the stream delivered.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from jobs.engine.processes import HOME_ENV, engine_processes, kill_processes
from jobs.load import loadgen
from jobs.schemas import BatchJob, RequestRecord, RunResult
from orchestrator.cluster.placement import NodeInventory
from orchestrator.core.db import database_health, is_unavailable, unit_of_work
from orchestrator.core.models import Run
from orchestrator.core.repositories import (
    OrchestratorRepository,
    ParityCheckRepository,
    RunRepository,
    utcnow,
)
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus, is_terminal
from orchestrator.core.telemetry import DISPATCHER_TICK, mark_dispatcher_running
from orchestrator.runs.launch import build_batch_job
from orchestrator.runs.logs import engine_log_from_disk, journal_from_disk
from orchestrator.runs.service import record_result
from orchestrator.schedules.service import fire_due_schedules

log = logging.getLogger(__name__)


@dataclass
class Poll:
    """What a backend knows about one active run."""

    done: bool
    results: list[RunResult] | None = None
    progress: dict[str, Any] | None = None
    error: str | None = None
    #: whether the run's supervisor answered this poll: one that did not (stopped, hung)
    #: gets no heartbeat for its runs and is not asked for records or samples
    answered: bool = True


@dataclass
class LaunchInfo:
    """What a launch got: the layout (nodes, ranks, devices) and the parity report if any."""

    placement: dict[str, Any]
    parity: dict[str, Any] | None = None


class NoCapacity(Exception):
    """The run fits the cluster but its devices are busy now: it stays queued."""


class LaunchRefused(Exception):
    """The cluster can never hold the run's shape (the message says why)."""


class LaunchBlocked(Exception):
    """Node parity failed before a launch (a multi-node launch's parity, or a chosen node
    without the engine environment): nothing was launched.

    The message names the blocking fields, then the per-node problems of the first
    findings that have them (``rank1:gpu-b: engine python /opt/vllm/bin/python does not
    exist on this node (...)``), at most :data:`BLOCKED_PROBLEMS_SHOWN`."""

    def __init__(self, report: dict[str, Any], placement: dict[str, Any]) -> None:
        self.report = report
        self.placement = placement
        fields = sorted({str(m.get("field")) for m in report.get("mismatches", [])})
        problems = [
            f"{node}: {text}"
            for m in report.get("mismatches", [])
            for node, text in (m.get("problems") or {}).items()
        ]
        shown = "; ".join(problems[:BLOCKED_PROBLEMS_SHOWN])
        more = len(problems) - BLOCKED_PROBLEMS_SHOWN
        detail = f" ({shown}{f'; {more} more' if more > 0 else ''})" if problems else ""
        super().__init__("node parity check failed: " + ", ".join(fields) + detail)


#: Per-node problems a :class:`LaunchBlocked` message names (the report holds them all).
BLOCKED_PROBLEMS_SHOWN = 3


class RunBackend(Protocol):
    #: the Ray resource one device maps to ("GPU" or "CPU"), as detected or set
    resource: str

    def resources(self) -> dict[str, float]: ...

    def nodes(self) -> list[NodeInventory]: ...

    def launch(self, run_id: str, job: BatchJob, layout: dict[str, Any]) -> LaunchInfo: ...

    def check_nodes(
        self,
        node_ids: list[str] | None,
        *,
        model_dir: str | None,
        engine_args: dict[str, Any],
        tp: int = 1,
        pp: int = 1,
        revision: str | None = None,
        by_id: bool = False,
    ) -> dict[str, Any]: ...

    def poll(self, run_id: str) -> Poll: ...

    def records(self, run_id: str, since: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        """Request records the batch's runs finished after ``since[run_id]`` of them."""
        ...

    def samples(self, run_id: str, since: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        """``/metrics`` samples the batch's runs took after ``since[run_id]`` of them."""
        ...

    def cancel(self, run_id: str) -> None: ...

    def attach(self, run_id: str) -> bool: ...

    def release(self, run_id: str) -> None: ...


@dataclass
class Dispatcher:
    settings: Settings
    session_factory: sessionmaker[Session]
    backend: RunBackend
    orchestrator_id: str = field(
        default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    )
    #: batch id (its first run's id) -> the run ids of the batch, in order
    active: dict[str, list[str]] = field(default_factory=dict)
    #: run id -> how many of its request records are in the database (streamed so far)
    streamed: dict[str, int] = field(default_factory=dict)
    #: run id -> how many of its ``/metrics`` samples are in the database
    streamed_samples: dict[str, int] = field(default_factory=dict)
    _last_reconcile: float = 0.0
    _last_heartbeat: float = 0.0
    _identity: IO[str] | None = None
    _started: bool = False

    # -- start-up: adopt or end what an earlier life left ----------------------------------

    @property
    def home(self) -> str:
        """This orchestrator's ``VLAB_HOME``, absolute: the marker of its engines."""
        return str(self.settings.home.resolve())

    def _identity_dir(self) -> Path:
        return self.settings.home / "orchestrators"

    def _hold_identity(self) -> None:
        """Hold ``<home>/orchestrators/<id>.lock`` (``flock``) for as long as this process lives."""
        folder = self._identity_dir()
        folder.mkdir(parents=True, exist_ok=True)
        # locked before it gets its name: no one ever sees it free while this one lives
        tmp = folder / f".{self.orchestrator_id}.tmp"
        fh = tmp.open("a+")
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        tmp.rename(folder / f"{self.orchestrator_id}.lock")
        self._identity = fh

    def _dead_predecessors(self) -> list[str]:
        """Ids of this home's orchestrators that died: their lock can be taken."""
        dead: list[str] = []
        folder = self._identity_dir()
        for path in sorted(folder.glob("*.lock")) if folder.is_dir() else []:
            if path.stem == self.orchestrator_id:
                continue
            with path.open("a+") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # alive
                dead.append(path.stem)
        return dead

    def startup(self) -> None:
        """Before anything is claimed: hold this orchestrator's identity, publish it,
        adopt or fail the runs of dead predecessors and stale runs (keeping what they
        measured), and kill every engine process of this home that no live run owns.
        Idempotent."""
        if self._started:
            return
        if self._identity is None:
            self._hold_identity()
        self.heartbeat()
        self.reconcile(startup=True)
        self._started = True

    def sweep_engines(self) -> list[int]:
        """Kill the engine processes on this machine that this home started and that no
        live run owns; returns the pids that were killed.

        Kept: the engines of runs this orchestrator holds (adopted or launched), and
        those of runs claimed by another live orchestrator of the same home (its
        heartbeat is fresh). Everything else marked with this home goes (SIGKILL to
        each process group, then to each process), before any new engine starts.
        """
        found = engine_processes(self.home)
        if not found:
            return []
        mine = {rid for ids in self.active.values() for rid in ids}
        run_ids = sorted({info["run_id"] for info in found.values()} - mine)
        with unit_of_work(self.session_factory) as s:
            others = RunRepository(s).held_by_live_orchestrators(
                run_ids, self.settings.orchestrator.stale_after_s, [self.orchestrator_id]
            )
        doomed = [pid for pid, info in found.items() if info["run_id"] not in mine | others]
        if doomed:
            log.warning(
                "ending %d orphaned engine processes of %s: %s",
                len(doomed),
                self.home,
                ", ".join(
                    f"{pid} ({found[pid]['title'][:40]}, run {found[pid]['run_id']})"
                    for pid in doomed
                ),
            )
            left = kill_processes(doomed)
            if left:
                log.error("engine processes survived SIGKILL: %s", left)
        return doomed

    def _fail_lost(self, repo: RunRepository, run: Run, reason: str) -> None:
        """End a run whose supervisor is gone: failed, keeping what it measured.

        Its request records and samples streamed so far stay, and those its journal on
        this machine's disk holds beyond them are added (:meth:`_recover_journal`); the
        metrics of its measured records are computed from them (the measured phase
        spanning the first start to the last end); ``partial`` when any succeeded; its
        engine log is read from disk.
        """
        journal = self._recover_journal(repo, run)
        rows = repo.request_rows(run.id)
        records = [
            RequestRecord(
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
            for r in rows
        ]
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

    def _recover_journal(self, repo: RunRepository, run: Run) -> dict[str, Any]:
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

    def heartbeat(self) -> None:
        """Publish this orchestrator's liveness and cluster resources (read by the API)."""
        with unit_of_work(self.session_factory) as s:
            resources: dict[str, Any] = dict(self.backend.resources())
            # the device kind this orchestrator runs with (auto-detected or set)
            resources["device_resource"] = self.backend.resource
            # per-node devices, so submissions can refuse shapes no node can hold
            resources["nodes"] = [
                {"node_id": n.node_id, "ip": n.ip, "total": n.total, "available": n.available}
                for n in self.backend.nodes()
            ]
            OrchestratorRepository(s).heartbeat(
                self.orchestrator_id, socket.gethostname(), resources
            )
        self._last_heartbeat = time.monotonic()

    def reconcile(self, startup: bool = False) -> list[str]:
        """Adopt or fail lost non-terminal runs, then sweep orphaned engines.

        Lost: a stale heartbeat, or (``startup``) claimed by an orchestrator of this
        home that died. Adopted when its supervisor still answers, else failed with
        what it measured kept (:meth:`_fail_lost`). Returns the ids that were failed.
        """
        failed: list[str] = []
        dead = self._dead_predecessors() if startup else []
        with unit_of_work(self.session_factory) as s:
            repo = RunRepository(s)
            lost = list(repo.stale_active(self.settings.orchestrator.stale_after_s))
            seen = {r.id for r in lost}
            lost += [r for r in repo.active_claimed_by(dead) if r.id not in seen]
            for run in lost:
                if any(run.id in ids for ids in self.active.values()):
                    continue
                if self.backend.attach(run.id):
                    run.claimed_by = self.orchestrator_id
                    repo.heartbeat(run.id, None)
                    self.active[run.id] = [run.id]
                    self.streamed[run.id] = repo.count_requests(run.id)
                    self.streamed_samples[run.id] = repo.count_samples(run.id)
                    log.info("re-attached to run %s", run.id)
                    continue
                if run.claimed_by in dead:
                    reason = (
                        f"the orchestrator that ran it ({run.claimed_by}) died, and the run's "
                        "supervisor and engine with it"
                    )
                else:
                    reason = "orchestrator restarted and the run's supervisor is gone"
                self._fail_lost(repo, run, reason)
                log.warning("run %s failed: %s", run.id, reason)
                failed.append(run.id)
        for oid in dead:
            with contextlib.suppress(OSError):
                (self._identity_dir() / f"{oid}.lock").unlink()
        try:
            self.sweep_engines()
        except Exception as exc:  # noqa: BLE001 - a failed sweep must not stop dispatching
            if is_unavailable(exc):  # an outage is logged once, by run_forever
                raise
            log.exception("sweeping orphaned engine processes failed")
        self._last_reconcile = time.monotonic()
        return failed

    def tick(self) -> None:
        """One round: poll active runs, fire due schedules, then claim at most one queued run.

        Its duration (failed ticks too) is ``vlab_dispatcher_tick_duration_seconds``."""
        with DISPATCHER_TICK.time():
            self._tick()

    def _tick(self) -> None:
        if time.monotonic() - self._last_heartbeat > 5.0:
            self.heartbeat()
        for batch_id in list(self.active):
            self._poll_one(batch_id)
        if time.monotonic() - self._last_reconcile > self.settings.orchestrator.stale_after_s / 2:
            self.reconcile()
        self._answer_parity_check()
        try:
            fire_due_schedules(self.session_factory, self.settings, now=utcnow())
        except Exception as exc:  # noqa: BLE001 - scheduled sweeps must not stop dispatching
            if is_unavailable(exc):  # an outage is logged once, by run_forever
                raise
            log.exception("firing scheduled sweeps failed")
        if len(self.active) < self.settings.orchestrator.max_concurrent_runs:
            self._claim_one()

    def _answer_parity_check(self) -> None:
        """Answer at most one pending ``POST /cluster/parity`` request."""
        with unit_of_work(self.session_factory) as s:
            repo = ParityCheckRepository(s)
            check = repo.claim_next(self.orchestrator_id)
            if check is None:
                return
            req = check.request
            try:
                report = self.backend.check_nodes(
                    req.get("node_ids"),
                    model_dir=req.get("model_path"),
                    engine_args=req.get("engine_args") or {},
                    tp=int(req.get("tensor_parallel_size", 1)),
                    pp=int(req.get("pipeline_parallel_size", 1)),
                )
            except Exception as exc:  # noqa: BLE001 - stored as the check's error
                log.warning("parity check %s failed: %s", check.id, exc)
                repo.finish(check, None, f"{type(exc).__name__}: {exc}"[:4000])
                return
            repo.finish(check, report)

    def _poll_one(self, batch_id: str) -> None:
        """Record the batch's results when it is done (a run without one, its supervisor
        lost, ends failed keeping what it measured: :meth:`_fail_lost`, and the engines no
        live run owns are swept at once); otherwise, when its supervisor answered, stream
        what its runs measured since the last tick and beat their hearts."""
        poll = self.backend.poll(batch_id)
        if self._record_poll(batch_id, poll):
            try:
                self.sweep_engines()
            except Exception as exc:  # noqa: BLE001 - the reconcile sweeps again
                if is_unavailable(exc):
                    raise
                log.exception("sweeping the engines of a lost run failed")

    def _record_poll(self, batch_id: str, poll: Poll) -> bool:
        """Write what ``poll`` says of the batch; True when a run of it was failed lost."""
        run_ids = self.active[batch_id]
        counted: tuple[dict[str, int], dict[str, int]] = ({}, {})
        lost = False
        with unit_of_work(self.session_factory) as s:
            repo = RunRepository(s)
            runs = [r for rid in run_ids if (r := repo.get(rid, for_update=True)) is not None]
            live = [r for r in runs if not is_terminal(r.status)]
            if not live:
                self.active.pop(batch_id, None)
                self.backend.release(batch_id)
                return False
            if poll.done:
                results = {res.run_id: res for res in poll.results or []}
                for run in live:
                    result = results.get(run.id)
                    if result is None:  # its supervisor is gone: keep what was measured
                        reason = poll.error or "the run supervisor returned no result for it"
                        self._fail_lost(repo, run, reason)
                        log.warning("run %s failed: %s", run.id, reason)
                        lost = True
                    else:
                        record_result(s, run, result)
                        log.info("run %s ended %s", run.id, result.status)
                    self.streamed.pop(run.id, None)
                    self.streamed_samples.pop(run.id, None)
                self.active.pop(batch_id, None)
                self.backend.release(batch_id)
                return lost
            if any(r.cancel_requested for r in live):
                self.backend.cancel(batch_id)  # the batch's server stops; its runs end cancelled
            if not poll.answered:  # silent: no heartbeat; the backend bounds the silence
                return False
            counted = self._stream_measured(repo, batch_id)
            progress = poll.progress or {}
            current = progress.get("run_id") or run_ids[0]
            for run in live:
                if run.id == current:
                    if run.status == RunStatus.PREPARING.value and progress.get("phase") in (
                        "warmup",
                        "measuring",
                    ):
                        repo.transition(run, RunStatus.RUNNING)
                    repo.heartbeat(run.id, progress or None)
                else:
                    repo.heartbeat(run.id, None)
        # counted once the rows are committed: a failed commit streams them again
        self.streamed.update(counted[0])
        self.streamed_samples.update(counted[1])
        return False

    def _stream_measured(
        self, repo: RunRepository, batch_id: str
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Write the request records and ``/metrics`` samples the batch's runs took since
        the last tick; returns how many of each (records, samples) each run has then."""
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
    ) -> dict[str, tuple[int, list[dict[str, Any]]]]:
        """``{run_id: (how many were streamed before, the new ones)}`` of the batch's runs
        (``{}`` when the backend does not answer: streaming is a safety net)."""
        since = {rid: streamed.get(rid, 0) for rid in self.active[batch_id]}
        try:
            new = fetch(batch_id, since)
        except Exception:  # noqa: BLE001 - streaming is a safety net, never a failure
            log.exception("reading the %s of batch %s failed", what, batch_id)
            return {}
        return {rid: (since[rid], rows) for rid, rows in new.items() if rid in since and rows}

    def _own(self, job: BatchJob) -> BatchJob:
        """``job`` marked as this home's (every engine process carries the home's
        absolute path) and judged with this service's failed-request threshold."""
        launch = job.launch.model_copy(update={"env": {**job.launch.env, HOME_ENV: self.home}})
        return job.model_copy(
            update={
                "launch": launch,
                "max_failed_fraction": self.settings.engine.max_failed_request_fraction,
            }
        )

    def _claim_one(self) -> None:
        with unit_of_work(self.session_factory) as s:
            repo = RunRepository(s)
            run = repo.claim_next_queued(self.orchestrator_id)
            if run is None:
                return
            batch = [run, *repo.claim_server_mates(run, self.orchestrator_id)]
            job = self._own(build_batch_job(self.settings, batch, self.backend.resource))
            try:
                info = self.backend.launch(run.id, job, run.layout)
            except NoCapacity:
                s.rollback()  # leaves the runs queued for a later tick
                return
            except LaunchBlocked as exc:
                log.warning("run %s blocked: %s", run.id, exc)
                for r in batch:
                    r.parity, r.placement = exc.report, exc.placement
                    repo.transition(r, RunStatus.BLOCKED, str(exc))
                    r.error = f"{exc}; see GET /api/v1/runs/{r.id}/parity"
                return
            except LaunchRefused as exc:
                for r in batch:
                    repo.transition(r, RunStatus.FAILED, str(exc))
                    r.error = str(exc)
                return
            except Exception as exc:  # noqa: BLE001 - any launch failure ends the runs
                log.exception("launch of run %s failed", run.id)
                for r in batch:
                    repo.transition(r, RunStatus.FAILED, f"launch failed: {exc}")
                    r.error = f"launch failed: {exc}"
                self.backend.release(run.id)
                return
            for r in batch:
                r.placement, r.parity = info.placement, info.parity
                # where the engine log is, should the run be lost before its end
                r.engine_info = {**(r.engine_info or {}), "log_path": job.launch.log_path}
                self.streamed[r.id] = self.streamed_samples[r.id] = 0
            self.active[run.id] = [r.id for r in batch]

    def run_forever(self, stop: threading.Event) -> None:
        """Tick every ``poll_interval_s`` until ``stop`` is set; cancel active runs on exit.

        Starts with :meth:`startup` (a no-op when the caller already ran it)."""
        self.startup()
        mark_dispatcher_running()  # this process's /metrics exports the dispatcher's series
        while not stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - keep the loop alive; the error is logged
                if is_unavailable(exc):  # one log line per outage, not a traceback per tick
                    database_health.failed(exc, "dispatcher")
                else:
                    log.exception("dispatcher tick failed")
            stop.wait(self.settings.orchestrator.poll_interval_s)
        self.shutdown()

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Cancel every active run and record what they return (engines torn down), then
        give up this orchestrator's identity (its lock file)."""
        for run_id in list(self.active):
            self.backend.cancel(run_id)
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            for run_id in list(self.active):
                try:
                    self._poll_one(run_id)
                except Exception:  # noqa: BLE001
                    log.exception("poll during shutdown failed")
            time.sleep(0.5)
        if self._identity is not None and not self.active:
            with contextlib.suppress(OSError):
                (self._identity_dir() / f"{self.orchestrator_id}.lock").unlink()
            self._identity.close()
            self._identity = None
