"""The parity loop's work: answer the node parity checks ``POST /cluster/parity`` asked for.

The API cannot reach Ray; it stores the request, and the dispatcher of some
orchestrator claims it (one at a time, ``SKIP LOCKED``), runs the check on the nodes
through its backend and stores the report, or the error when the check could not run.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.db import unit_of_work
from orchestrator.core.repositories import ParityCheckRepository
from orchestrator.dispatch.run_backend import RunBackend

log = logging.getLogger(__name__)


def answer_parity_check(
    session_factory: sessionmaker[Session], backend: RunBackend, orchestrator_id: str
) -> None:
    """Answer at most one pending ``POST /cluster/parity`` request."""
    with unit_of_work(session_factory) as s:
        repo = ParityCheckRepository(s)
        check = repo.claim_next(orchestrator_id)
        if check is None:
            return
        req = check.request
        try:
            report = backend.check_nodes(
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
