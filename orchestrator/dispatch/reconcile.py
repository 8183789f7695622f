"""The reconcile loop's work: adopt or end lost runs, then sweep orphaned engines.

A run is lost when its heartbeat went stale (``orchestrator.stale_after_s``), or, at
start-up, when it was claimed by an orchestrator of this ``VLAB_HOME`` that died (its
lock could be taken: :mod:`orchestrator.dispatch.identity`). A lost run whose
supervisor still answers is re-attached; otherwise it fails keeping what it measured
(:func:`orchestrator.dispatch.lost_runs.fail_lost`).

No orphans, ever: every engine process on this machine that this home started (they
all carry ``VLAB_ENGINE_HOME`` and ``VLAB_RUN_ID``) and that no live run owns is
killed (:meth:`Reconciler.sweep_engines`), at start-up before anything is claimed,
at each reconcile, and at once after a run was failed lost.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from jobs.engine.processes import engine_processes, kill_processes
from orchestrator.core.db import is_unavailable, unit_of_work
from orchestrator.core.models import Run
from orchestrator.core.repositories import RunRepository
from orchestrator.core.settings import Settings
from orchestrator.dispatch.active_runs import ActiveRuns
from orchestrator.dispatch.identity import Identity
from orchestrator.dispatch.lost_runs import fail_lost
from orchestrator.dispatch.run_backend import RunBackend

log = logging.getLogger(__name__)


@dataclass
class Reconciler:
    settings: Settings
    session_factory: sessionmaker[Session]
    backend: RunBackend
    runs: ActiveRuns
    identity: Identity

    @property
    def home(self) -> str:
        """This orchestrator's ``VLAB_HOME``, absolute: the marker of its engines."""
        return str(self.settings.home.resolve())

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
        mine = self.runs.run_ids()
        run_ids = sorted({info["run_id"] for info in found.values()} - mine)
        with unit_of_work(self.session_factory) as s:
            others = RunRepository(s).held_by_live_orchestrators(
                run_ids, self.settings.orchestrator.stale_after_s, [self.identity.orchestrator_id]
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

    def reconcile(self, startup: bool = False) -> list[str]:
        """Adopt or fail lost non-terminal runs, then sweep orphaned engines.

        Lost: a stale heartbeat, or (``startup``) claimed by an orchestrator of this
        home that died. Adopted when its supervisor still answers, else failed with
        what it measured kept. Returns the ids that were failed.
        """
        failed: list[str] = []
        dead = self.identity.dead_predecessors() if startup else []
        with unit_of_work(self.session_factory) as s:
            repo = RunRepository(s)
            lost = list(repo.stale_active(self.settings.orchestrator.stale_after_s))
            seen = {r.id for r in lost}
            lost += [r for r in repo.active_claimed_by(dead) if r.id not in seen]
            held = self.runs.run_ids()
            for run in lost:
                if run.id not in held and not self._adopt(repo, run):
                    self._end(repo, run, dead)
                    failed.append(run.id)
        for oid in dead:
            self.identity.forget(oid)
        try:
            self.sweep_engines()
        except Exception as exc:  # noqa: BLE001 - a failed sweep must not stop dispatching
            if is_unavailable(exc):  # an outage is logged once, by the loop runner
                raise
            log.exception("sweeping orphaned engine processes failed")
        return failed

    def _adopt(self, repo: RunRepository, run: Run) -> bool:
        """Re-attach to a lost run whose supervisor still answers; False when it is gone."""
        if not self.backend.attach(run.id):
            return False
        run.claimed_by = self.identity.orchestrator_id
        repo.heartbeat(run.id, None)
        self.runs.hold([run.id], repo.count_requests(run.id), repo.count_samples(run.id))
        log.info("re-attached to run %s", run.id)
        return True

    def _end(self, repo: RunRepository, run: Run, dead: list[str]) -> None:
        """Fail a lost run that cannot be re-attached, keeping what it measured."""
        if run.claimed_by in dead:
            reason = (
                f"the orchestrator that ran it ({run.claimed_by}) died, and the run's "
                "supervisor and engine with it"
            )
        else:
            reason = "orchestrator restarted and the run's supervisor is gone"
        fail_lost(repo, run, reason)
        log.warning("run %s failed: %s", run.id, reason)
