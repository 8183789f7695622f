"""The claim loop's work: take at most one queued run (with its server mates) and launch it.

Claiming uses ``SELECT ... FOR UPDATE SKIP LOCKED``, so several orchestrators can
share one database without taking the same run. The queued runs that can share the
claimed run's vLLM server (they differ only in client-side settings) are taken with
it as one batch. The launch happens inside the claim's transaction: an orchestrator
killed before it commits leaves the runs queued.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from jobs.engine.processes import HOME_ENV
from jobs.schemas import BatchJob
from orchestrator.core.db import unit_of_work
from orchestrator.core.models import Run
from orchestrator.core.repositories import RunRepository
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus
from orchestrator.dispatch.active_runs import ActiveRuns
from orchestrator.dispatch.run_backend import (
    LaunchBlocked,
    LaunchInfo,
    LaunchRefused,
    NoCapacity,
    RunBackend,
)
from orchestrator.runs.launch import build_batch_job

log = logging.getLogger(__name__)


@dataclass
class Claimer:
    settings: Settings
    session_factory: sessionmaker[Session]
    backend: RunBackend
    runs: ActiveRuns
    orchestrator_id: str
    #: this orchestrator's ``VLAB_HOME``, absolute: every engine it starts carries it
    home: str

    def has_room(self) -> bool:
        """Whether fewer batches than ``orchestrator.max_concurrent_runs`` are held."""
        return len(self.runs.active) < self.settings.orchestrator.max_concurrent_runs

    def claim_if_room(self) -> None:
        """One turn of the claim loop: claim and launch at most one queued run, when
        there is room for it."""
        if self.has_room():
            self.claim_one()

    def own(self, job: BatchJob) -> BatchJob:
        """``job`` marked as this home's (every engine process carries the home's
        absolute path) and judged with this service's failed-request threshold."""
        launch = job.launch.model_copy(update={"env": {**job.launch.env, HOME_ENV: self.home}})
        return job.model_copy(
            update={
                "launch": launch,
                "max_failed_fraction": self.settings.engine.max_failed_request_fraction,
            }
        )

    def claim_one(self) -> None:
        """Claim the next queued run and its server mates, and launch them as one batch.

        No free devices: the runs stay queued. A shape the cluster can never hold, or
        any other launch failure: the runs fail. Node parity blocking: they end
        ``blocked`` with the report."""
        with unit_of_work(self.session_factory) as s:
            repo = RunRepository(s)
            run = repo.claim_next_queued(self.orchestrator_id)
            if run is None:
                return
            batch = [run, *repo.claim_server_mates(run, self.orchestrator_id)]
            job = self.own(build_batch_job(self.settings, batch, self.backend.resource))
            try:
                info = self.backend.launch(run.id, job, run.layout)
            except NoCapacity:
                s.rollback()  # leaves the runs queued for a later turn
                return
            except LaunchBlocked as exc:
                log.warning("run %s blocked: %s", run.id, exc)
                for r in batch:
                    r.parity, r.placement = exc.report, exc.placement
                    repo.transition(r, RunStatus.BLOCKED, str(exc))
                    r.error = f"{exc}; see GET /api/v1/runs/{r.id}/parity"
                return
            except LaunchRefused as exc:
                self._fail(repo, batch, str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - any launch failure ends the runs
                log.exception("launch of run %s failed", run.id)
                self._fail(repo, batch, f"launch failed: {exc}")
                self.backend.release(run.id)
                return
            self._launched(batch, job, info)

    def _fail(self, repo: RunRepository, batch: list[Run], error: str) -> None:
        for r in batch:
            repo.transition(r, RunStatus.FAILED, error)
            r.error = error

    def _launched(self, batch: list[Run], job: BatchJob, info: LaunchInfo) -> None:
        for r in batch:
            r.placement, r.parity = info.placement, info.parity
            # where the engine log is, should the run be lost before its end
            r.engine_info = {**(r.engine_info or {}), "log_path": job.launch.log_path}
        self.runs.hold([r.id for r in batch])
