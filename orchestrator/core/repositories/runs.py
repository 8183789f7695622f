"""Runs and what they measured: status changes, claims, metrics, samples, requests, logs."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from orchestrator.core.models import (
    RUN_SORT_METRICS,
    Experiment,
    Orchestrator,
    Run,
    RunLog,
    RunMetric,
    RunRequest,
    RunSample,
)
from orchestrator.core.repositories.base import utcnow
from orchestrator.core.states import CLAIMED, TERMINAL, RunStatus, check_transition


class RunRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, run: Run) -> Run:
        self.session.add(run)
        self.session.flush()
        return run

    def get(self, run_id: str, *, for_update: bool = False) -> Run | None:
        stmt = select(Run).where(Run.id == run_id)
        if for_update:
            stmt = stmt.with_for_update()
        return self.session.scalars(stmt).first()

    def page(
        self,
        *,
        experiment_id: str | None = None,
        status: str | None = None,
        limit: int,
        offset: int,
    ) -> tuple[Sequence[Run], int]:
        conds = []
        if experiment_id:
            conds.append(Run.experiment_id == experiment_id)
        if status:
            conds.append(Run.status == status)
        total = self.session.scalar(select(func.count()).select_from(Run).where(*conds)) or 0
        order = (Run.position, Run.id) if experiment_id else (Run.created_at.desc(), Run.position)
        rows = self.session.scalars(
            select(Run).where(*conds).order_by(*order).limit(limit).offset(offset)
        ).all()
        return rows, total

    def claim_next_queued(self, orchestrator_id: str) -> Run | None:
        """Claim the oldest queued run: ``queued -> preparing``.

        Uses ``SELECT ... FOR UPDATE SKIP LOCKED`` so two orchestrators never
        take the same run. Returns ``None`` when nothing is queued.
        """
        run = self.session.scalars(
            select(Run)
            .where(Run.status == RunStatus.QUEUED.value)
            .order_by(Run.created_at, Run.sequence, Run.id)
            .limit(1)
            .with_for_update(skip_locked=True)
        ).first()
        if run is None:
            return None
        self.transition(run, RunStatus.PREPARING)
        now = utcnow()
        run.claimed_by = orchestrator_id
        run.claimed_at = now
        run.heartbeat_at = now
        self.session.flush()
        return run

    def claim_server_mates(self, run: Run, orchestrator_id: str, limit: int = 50) -> list[Run]:
        """Claim the queued runs that directly follow ``run`` and can share its vLLM server.

        Same experiment and ``server_key``, consecutive in ``sequence`` order
        (the interleaved plan puts them next to each other); stops at the first
        run that differs, is not queued, or is locked by another orchestrator.
        """
        if not run.server_key:
            return []
        following = self.session.scalars(
            select(Run)
            .where(Run.experiment_id == run.experiment_id, Run.sequence > run.sequence)
            .order_by(Run.sequence)
            .limit(limit)
        ).all()
        mates: list[Run] = []
        for nxt in following:
            if nxt.server_key != run.server_key or nxt.status != RunStatus.QUEUED.value:
                break
            locked = self.session.scalars(
                select(Run)
                .where(Run.id == nxt.id, Run.status == RunStatus.QUEUED.value)
                .with_for_update(skip_locked=True)
            ).first()
            if locked is None:
                break
            self.transition(locked, RunStatus.PREPARING)
            locked.claimed_by = orchestrator_id
            locked.claimed_at = locked.heartbeat_at = utcnow()
            mates.append(locked)
        self.session.flush()
        return mates

    def transition(self, run: Run, new: RunStatus, reason: str | None = None) -> None:
        """Move ``run`` through the state machine (raises on a forbidden move)."""
        check_transition(run.status, new.value)
        run.status = new.value
        now = utcnow()
        if reason is not None:
            run.status_reason = reason
        if new == RunStatus.RUNNING and run.started_at is None:
            run.started_at = now
        if new in TERMINAL:
            run.finished_at = now
        self.session.flush()

    def heartbeat(self, run_id: str, progress: dict[str, Any] | None) -> None:
        values: dict[str, Any] = {"heartbeat_at": utcnow()}
        if progress is not None:
            values["progress"] = progress
        self.session.execute(update(Run).where(Run.id == run_id).values(**values))

    def stale_active(self, stale_after_s: float) -> Sequence[Run]:
        """Non-terminal, claimed runs whose heartbeat is older than ``stale_after_s``."""
        cutoff = utcnow() - timedelta(seconds=stale_after_s)
        return self.session.scalars(
            select(Run)
            .where(
                Run.status.in_(sorted(CLAIMED)),
                or_(Run.heartbeat_at.is_(None), Run.heartbeat_at < cutoff),
            )
            .with_for_update(skip_locked=True)
        ).all()

    def claimed_by(self, orchestrator_id: str) -> Sequence[Run]:
        return self.session.scalars(
            select(Run).where(
                Run.claimed_by == orchestrator_id,
                Run.status.in_(sorted(CLAIMED)),
            )
        ).all()

    def save_measurements(
        self,
        run_id: str,
        *,
        metrics: dict[str, float],
        samples: list[dict[str, Any]],
        requests: list[dict[str, Any]],
        engine_log: str,
    ) -> None:
        """Replace the run's measurements (metrics, samples, requests, log) in one go.

        Rows go in as bulk ``INSERT``s (one executemany per table, which psycopg 3
        pipelines), not one ORM object per row: a run can have 20k request records
        and thousands of samples.
        """
        for model in (RunMetric, RunSample, RunRequest, RunLog):
            self.session.execute(delete(model).where(model.run_id == run_id))
        if metrics:
            self.session.execute(
                insert(RunMetric),
                [{"run_id": run_id, "name": k, "value": float(v)} for k, v in metrics.items()],
            )
        if samples:
            self.session.execute(
                insert(RunSample),
                [
                    {"run_id": run_id, "t_s": s["t_s"], "phase": s["phase"], "values": s["values"]}
                    for s in samples
                ],
            )
        self._store_sort_keys(run_id, metrics)
        if requests:
            self.session.execute(
                insert(RunRequest), [_request_row(run_id, i, r) for i, r in enumerate(requests)]
            )
        self.session.add(RunLog(run_id=run_id, content=engine_log.replace("\x00", "")))
        self.session.flush()

    def _store_sort_keys(self, run_id: str, metrics: dict[str, float]) -> None:
        """Copy the run history's sort metrics (:data:`RUN_SORT_METRICS`) onto the run,
        None for each one ``metrics`` lacks: written wherever the run's metrics are."""
        self.session.execute(
            update(Run)
            .where(Run.id == run_id)
            .values(
                {
                    col: float(metrics[name]) if name in metrics else None
                    for name, col in RUN_SORT_METRICS.items()
                }
            )
            .execution_options(synchronize_session="fetch")
        )

    def sync_sort_keys(self, run_ids: Collection[str]) -> None:
        """Set the sort-key columns of ``run_ids`` from their stored ``run_metrics`` (for
        metrics written row by row, e.g. by a data fixture): one UPDATE."""
        if not run_ids:
            return
        pivot = {
            col: func.max(RunMetric.value).filter(RunMetric.name == name).label(col)
            for name, col in RUN_SORT_METRICS.items()
        }
        m = (
            select(RunMetric.run_id, *pivot.values())
            .where(RunMetric.run_id.in_(list(run_ids)))
            .group_by(RunMetric.run_id)
            .subquery()
        )
        self.session.execute(
            update(Run)
            .where(Run.id == m.c.run_id)
            .values({col: m.c[col] for col in RUN_SORT_METRICS.values()})
            .execution_options(synchronize_session=False)
        )

    def metrics(self, run_id: str) -> dict[str, float]:
        rows = self.session.execute(
            select(RunMetric.name, RunMetric.value).where(RunMetric.run_id == run_id)
        ).all()
        return {name: value for name, value in rows}

    def metrics_for(
        self, run_ids: list[str], names: Collection[str] | None = None
    ) -> dict[str, dict[str, float]]:
        """The summary metrics of ``run_ids`` (only ``names``, when given) by run id."""
        out: dict[str, dict[str, float]] = {rid: {} for rid in run_ids}
        if not run_ids:
            return out
        conds = [RunMetric.run_id.in_(run_ids)]
        if names is not None:
            conds.append(RunMetric.name.in_(list(names)))
        rows = self.session.execute(
            select(RunMetric.run_id, RunMetric.name, RunMetric.value).where(*conds)
        ).all()
        for rid, name, value in rows:
            out[rid][name] = value
        return out

    def samples(self, run_id: str) -> Sequence[RunSample]:
        return self.session.scalars(
            select(RunSample).where(RunSample.run_id == run_id).order_by(RunSample.id)
        ).all()

    def requests(
        self,
        run_id: str,
        *,
        limit: int,
        offset: int,
        request_class: str | None = None,
        warmup: bool | None = None,
    ) -> tuple[Sequence[RunRequest], int]:
        """A page of the run's request records in send order, and how many match."""
        conds = [RunRequest.run_id == run_id]
        if request_class is not None:
            conds.append(RunRequest.request_class == request_class)
        if warmup is not None:
            conds.append(RunRequest.warmup.is_(warmup))
        total = self.session.scalar(select(func.count()).select_from(RunRequest).where(*conds)) or 0
        rows = self.session.scalars(
            select(RunRequest).where(*conds).order_by(RunRequest.seq).limit(limit).offset(offset)
        ).all()
        return rows, total

    def log(self, run_id: str) -> str | None:
        return self.session.scalar(select(RunLog.content).where(RunLog.run_id == run_id))

    def with_experiments(self, run_ids: list[str]) -> list[tuple[Run, str, int]]:
        """(run, experiment name, experiment repeats) of ``run_ids``, in ``run_ids`` order
        (unknown ids left out); one query, runs joined with their experiments."""
        rows = self.session.execute(
            select(Run, Experiment.name, Experiment.repeats)
            .join(Experiment, Run.experiment_id == Experiment.id)
            .where(Run.id.in_(run_ids))
        ).all()
        by_id = {run.id: (run, name, repeats) for run, name, repeats in rows}
        return [by_id[i] for i in run_ids if i in by_id]

    def statuses_of_experiments(self, experiment_ids: list[str]) -> list[tuple[str, str, str]]:
        """(experiment id, run id, status) of every run of ``experiment_ids``, in that order."""
        rows = self.session.execute(
            select(Run.experiment_id, Run.id, Run.status)
            .where(Run.experiment_id.in_(experiment_ids))
            .order_by(Run.experiment_id, Run.id)
        ).all()
        return [(exp_id, run_id, status) for exp_id, run_id, status in rows]

    # -- what a run measured while it went (kept if it never ends normally) -------------

    def count_requests(self, run_id: str) -> int:
        """How many request records the run has stored."""
        return int(
            self.session.scalar(
                select(func.count()).select_from(RunRequest).where(RunRequest.run_id == run_id)
            )
            or 0
        )

    def append_requests(self, run_id: str, first_seq: int, requests: list[dict[str, Any]]) -> None:
        """Add request records (``RequestRecord.model_dump()``) as they finish, ``seq`` from
        ``first_seq`` on (finishing order). :meth:`save_measurements` replaces them all
        with the run's final list when it ends; a run lost before its end keeps these."""
        if not requests:
            return
        self.session.execute(
            pg_insert(RunRequest)
            .values([_request_row(run_id, first_seq + i, r) for i, r in enumerate(requests)])
            .on_conflict_do_nothing(index_elements=[RunRequest.run_id, RunRequest.seq])
        )

    def insert_requests(self, run_id: str, by_seq: dict[int, dict[str, Any]]) -> int:
        """Add request records (``RequestRecord.model_dump()``) at the given ``seq``s, those
        the run has not stored yet (a run's journal read back); returns how many went in."""
        have = set(
            self.session.scalars(select(RunRequest.seq).where(RunRequest.run_id == run_id)).all()
        )
        rows = [
            _request_row(run_id, seq, r) for seq, r in sorted(by_seq.items()) if seq not in have
        ]
        if rows:
            self.session.execute(
                pg_insert(RunRequest)
                .values(rows)
                .on_conflict_do_nothing(index_elements=[RunRequest.run_id, RunRequest.seq])
            )
        return len(rows)

    def count_samples(self, run_id: str) -> int:
        """How many ``/metrics`` samples the run has stored."""
        return int(
            self.session.scalar(
                select(func.count()).select_from(RunSample).where(RunSample.run_id == run_id)
            )
            or 0
        )

    def append_samples(self, run_id: str, samples: list[dict[str, Any]]) -> None:
        """Add ``/metrics`` samples (``MetricSample.model_dump()``) after the stored ones, as
        they are taken. :meth:`save_measurements` replaces them with the run's final list
        when it ends; a run lost before its end keeps these."""
        if samples:
            self.session.execute(
                insert(RunSample),
                [
                    {"run_id": run_id, "t_s": s["t_s"], "phase": s["phase"], "values": s["values"]}
                    for s in samples
                ],
            )

    def request_rows(self, run_id: str) -> Sequence[RunRequest]:
        """Every request record of the run, in ``seq`` order."""
        return self.session.scalars(
            select(RunRequest).where(RunRequest.run_id == run_id).order_by(RunRequest.seq)
        ).all()

    def request_rows_for(self, run_ids: list[str]) -> Sequence[RunRequest]:
        """Every request record of these runs, in ``seq`` order (runs interleaved)."""
        if not run_ids:
            return []
        return self.session.scalars(
            select(RunRequest).where(RunRequest.run_id.in_(run_ids)).order_by(RunRequest.seq)
        ).all()

    def save_recovered(self, run_id: str, *, metrics: dict[str, float], engine_log: str) -> None:
        """Store what could be recovered of a run lost before its end: the metrics of its
        stored request records and its engine log (read from disk), next to those records."""
        self.session.execute(delete(RunMetric).where(RunMetric.run_id == run_id))
        if metrics:
            self.session.execute(
                insert(RunMetric),
                [{"run_id": run_id, "name": k, "value": float(v)} for k, v in metrics.items()],
            )
        self._store_sort_keys(run_id, metrics)
        if engine_log and self.log(run_id) is None:
            self.session.add(RunLog(run_id=run_id, content=engine_log.replace("\x00", "")))
        self.session.flush()

    def active_claimed_by(self, orchestrator_ids: list[str]) -> Sequence[Run]:
        """Non-terminal runs claimed by any of ``orchestrator_ids`` (locked, ``SKIP LOCKED``)."""
        if not orchestrator_ids:
            return []
        return self.session.scalars(
            select(Run)
            .where(
                Run.claimed_by.in_(orchestrator_ids),
                Run.status.in_(sorted(CLAIMED)),
            )
            .with_for_update(skip_locked=True)
        ).all()

    def held_by_live_orchestrators(
        self, run_ids: list[str], stale_after_s: float, exclude: list[str]
    ) -> set[str]:
        """Those of ``run_ids`` claimed by an orchestrator whose heartbeat is younger than
        ``stale_after_s`` seconds, other than the ``exclude`` ones."""
        if not run_ids:
            return set()
        cutoff = utcnow() - timedelta(seconds=stale_after_s)
        rows = self.session.scalars(
            select(Run.id)
            .join(Orchestrator, Orchestrator.id == Run.claimed_by)
            .where(
                Run.id.in_(run_ids),
                Orchestrator.heartbeat_at >= cutoff,
                Orchestrator.id.not_in(exclude or [""]),
            )
        ).all()
        return set(rows)

    def count_by_status(self) -> dict[str, int]:
        """``{status: number of runs}`` over every run, for the service's ``/metrics``; a
        status no run has is absent."""
        rows = self.session.execute(select(Run.status, func.count()).group_by(Run.status)).all()
        return {str(status): int(n) for status, n in rows}

    def oldest_queued_age_s(self) -> float | None:
        """Seconds since the oldest queued run was created, on the database's clock
        (``clock_timestamp()``: the real time, not the transaction's start); None when
        nothing is queued. The dispatcher claims in ``created_at`` order, so this is the
        wait of the next run it would take."""
        waited = func.clock_timestamp() - func.min(Run.created_at)
        age = self.session.scalar(
            select(func.extract("epoch", waited)).where(Run.status == RunStatus.QUEUED.value)
        )
        return None if age is None else float(age)

    def newest_gpu_memory(self, scan: int = 1000) -> tuple[str, float] | None:
        """``(run id, MiB)``: the smallest GPU memory the newest succeeded GPU run among
        the newest ``scan`` runs recorded for its GPUs (``engine_info.gpu_assignment``);
        None when none of them did."""
        newest = (
            select(Run.id, Run.status, Run.placement, Run.created_at)
            .order_by(Run.created_at.desc())
            .limit(scan)
            .subquery()
        )
        rows = self.session.execute(
            select(Run.id, Run.engine_info)
            .join(newest, newest.c.id == Run.id)
            .where(
                newest.c.status == RunStatus.SUCCEEDED.value,
                newest.c.placement["resource"].as_string() == "GPU",
            )
            .order_by(newest.c.created_at.desc())
            .limit(20)
        ).all()
        for run_id, engine_info in rows:
            info = engine_info or {}
            memories = [
                float(g["memory_total_mib"])
                for node in info.get("gpu_assignment") or []
                for g in node.get("gpus") or []
                if isinstance(g.get("memory_total_mib"), int | float)
            ]
            if memories:
                return str(run_id), min(memories)
        return None


def _request_row(run_id: str, seq: int, r: dict[str, Any]) -> dict[str, Any]:
    """The ``run_requests`` row of one ``RequestRecord.model_dump()``."""
    return {
        "run_id": run_id,
        "seq": seq,
        "request_index": r["index"],
        "warmup": r["warmup"],
        "request_class": r.get("request_class"),
        "success": r["success"],
        "error": r.get("error"),
        "start_s": r["start_s"],
        "ttft_s": r.get("ttft_s"),
        "tpot_s": r.get("tpot_s"),
        "e2el_s": r.get("e2el_s"),
        "itl_s": r.get("itl_s") or [],
        "prompt_tokens": r.get("prompt_tokens"),
        "output_tokens": r.get("output_tokens"),
        "cached_tokens": r.get("cached_tokens"),
        "scheduled_s": r.get("scheduled_s"),
        "conversation": r.get("conversation"),
        "turn": r.get("turn"),
    }
