"""Every query the service makes lives here. Repositories never commit.

The caller owns the transaction (see :func:`orchestrator.core.db.unit_of_work`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from orchestrator.cluster.placement import NodeInventory
from orchestrator.core.models import (
    ApiToken,
    AuditEvent,
    Experiment,
    Orchestrator,
    ParityCheck,
    Run,
    RunLog,
    RunMetric,
    RunRequest,
    RunSample,
    Schedule,
    ScheduleFire,
    WebSession,
    new_id,
)
from orchestrator.core.states import TERMINAL, RunStatus, check_transition


def utcnow() -> datetime:
    return datetime.now(UTC)


class ExperimentRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, experiment: Experiment) -> Experiment:
        self.session.add(experiment)
        self.session.flush()
        return experiment

    def get(self, experiment_id: str) -> Experiment | None:
        return self.session.get(Experiment, experiment_id)

    def page(self, *, limit: int, offset: int) -> tuple[Sequence[Experiment], int]:
        total = self.session.scalar(select(func.count()).select_from(Experiment)) or 0
        rows = self.session.scalars(
            select(Experiment)
            .order_by(Experiment.created_at.desc(), Experiment.id)
            .limit(limit)
            .offset(offset)
        ).all()
        return rows, total


class RunRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

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
                Run.status.in_([RunStatus.PREPARING.value, RunStatus.RUNNING.value]),
                or_(Run.heartbeat_at.is_(None), Run.heartbeat_at < cutoff),
            )
            .with_for_update(skip_locked=True)
        ).all()

    def claimed_by(self, orchestrator_id: str) -> Sequence[Run]:
        return self.session.scalars(
            select(Run).where(
                Run.claimed_by == orchestrator_id,
                Run.status.in_([RunStatus.PREPARING.value, RunStatus.RUNNING.value]),
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
        if requests:
            self.session.execute(
                insert(RunRequest), [_request_row(run_id, i, r) for i, r in enumerate(requests)]
            )
        self.session.add(RunLog(run_id=run_id, content=engine_log.replace("\x00", "")))
        self.session.flush()

    def metrics(self, run_id: str) -> dict[str, float]:
        rows = self.session.execute(
            select(RunMetric.name, RunMetric.value).where(RunMetric.run_id == run_id)
        ).all()
        return {name: value for name, value in rows}

    def metrics_for(self, run_ids: list[str]) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {rid: {} for rid in run_ids}
        if not run_ids:
            return out
        rows = self.session.execute(
            select(RunMetric.run_id, RunMetric.name, RunMetric.value).where(
                RunMetric.run_id.in_(run_ids)
            )
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

    def request_rows(self, run_id: str) -> Sequence[RunRequest]:
        """Every request record of the run, in ``seq`` order."""
        return self.session.scalars(
            select(RunRequest).where(RunRequest.run_id == run_id).order_by(RunRequest.seq)
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
                Run.status.in_([RunStatus.PREPARING.value, RunStatus.RUNNING.value]),
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


class OrchestratorRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def heartbeat(self, orchestrator_id: str, hostname: str, resources: dict[str, Any]) -> None:
        """Insert or refresh this orchestrator's row (``INSERT ... ON CONFLICT``)."""
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        now = utcnow()
        stmt = pg_insert(Orchestrator).values(
            id=orchestrator_id, hostname=hostname, heartbeat_at=now, resources=resources
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[Orchestrator.id],
            set_={"heartbeat_at": now, "resources": resources},
        )
        self.session.execute(stmt)

    def cluster_nodes(self, resource: str, stale_after_s: float) -> list[NodeInventory] | None:
        """The nodes (devices of ``resource`` each) the live orchestrator with most devices sees.

        None when no orchestrator is live or none published its nodes.
        """
        cutoff = utcnow() - timedelta(seconds=stale_after_s)
        rows = self.session.scalars(
            select(Orchestrator.resources).where(Orchestrator.heartbeat_at >= cutoff)
        ).all()
        best: list[NodeInventory] | None = None
        for r in rows:
            docs = r.get("nodes")
            if not isinstance(docs, list):
                continue
            nodes = [
                NodeInventory(
                    node_id=str(d["node_id"]),
                    ip=str(d.get("ip", "")),
                    total=int(d["total"]),
                    available=min(int(d["total"]), int(d.get("available") or 0)),
                )
                for d in docs
                if isinstance(d, dict) and "node_id" in d and "total" in d
            ]
            if best is None or sum(n.total for n in nodes) > sum(n.total for n in best):
                best = nodes
        return best

    def cluster_devices(self, resource: str, stale_after_s: float) -> int | None:
        """The most ``resource`` devices a live orchestrator reports; None when none is live.

        ``resource`` ``"auto"``: each orchestrator's own detected device kind
        (``device_resource`` in its heartbeat; CPU when it published none).
        """
        cutoff = utcnow() - timedelta(seconds=stale_after_s)
        rows = self.session.scalars(
            select(Orchestrator.resources).where(Orchestrator.heartbeat_at >= cutoff)
        ).all()
        counts = [int(float(r.get(_kind(r, resource), 0) or 0)) for r in rows]
        return max(counts) if counts else None

    def device_kind(self, resource: str, stale_after_s: float) -> str:
        """The device kind in force: ``resource`` when set, else the one live orchestrators
        detected (``"GPU"`` when any of them detected GPUs), else ``"CPU"``."""
        if resource != "auto":
            return resource
        cutoff = utcnow() - timedelta(seconds=stale_after_s)
        rows = self.session.scalars(
            select(Orchestrator.resources).where(Orchestrator.heartbeat_at >= cutoff)
        ).all()
        kinds = {_kind(r, resource) for r in rows}
        return "GPU" if "GPU" in kinds else "CPU"


def _kind(resources: dict[str, Any], resource: str) -> str:
    """``resource``, or for ``"auto"`` the kind an orchestrator published in its heartbeat."""
    if resource != "auto":
        return resource
    kind = resources.get("device_resource")
    return kind if kind in ("CPU", "GPU") else "CPU"


class ParityCheckRepository:
    """On-demand parity checks: stored by the API, answered by an orchestrator."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, request: dict[str, Any]) -> ParityCheck:
        check = ParityCheck(request=request, status="pending")
        self.session.add(check)
        self.session.flush()
        return check

    def get(self, check_id: str) -> ParityCheck | None:
        return self.session.get(ParityCheck, check_id)

    def claim_next(self, orchestrator_id: str) -> ParityCheck | None:
        """The oldest pending check, marked ``running`` (``FOR UPDATE SKIP LOCKED``)."""
        check = self.session.scalars(
            select(ParityCheck)
            .where(ParityCheck.status == "pending")
            .order_by(ParityCheck.created_at)
            .limit(1)
            .with_for_update(skip_locked=True)
        ).first()
        if check is not None:
            check.status = "running"
            check.claimed_by = orchestrator_id
            self.session.flush()
        return check

    def finish(
        self, check: ParityCheck, report: dict[str, Any] | None, error: str | None = None
    ) -> None:
        check.status = "done" if error is None else "failed"
        check.report = report
        check.error = error
        check.finished_at = utcnow()
        self.session.flush()


class ScheduleRepository:
    """Schedules and their fires (scheduled sweeps, :mod:`orchestrator.schedules.service`)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, schedule: Schedule) -> Schedule:
        self.session.add(schedule)
        self.session.flush()
        return schedule

    def get(self, schedule_id: str) -> Schedule | None:
        return self.session.get(Schedule, schedule_id)

    def by_name(self, name: str) -> Schedule | None:
        return self.session.scalar(select(Schedule).where(Schedule.name == name))

    def page(self, *, limit: int, offset: int) -> tuple[Sequence[Schedule], int]:
        total = self.session.scalar(select(func.count()).select_from(Schedule)) or 0
        rows = self.session.scalars(
            select(Schedule)
            .order_by(Schedule.created_at.desc(), Schedule.id)
            .limit(limit)
            .offset(offset)
        ).all()
        return rows, total

    def delete(self, schedule: Schedule) -> None:
        self.session.delete(schedule)
        self.session.flush()

    def due_ids(self, now: datetime) -> list[str]:
        """Ids of enabled schedules whose ``next_fire_at`` is at or before ``now`` (indexed)."""
        return list(
            self.session.scalars(
                select(Schedule.id)
                .where(Schedule.enabled.is_(True), Schedule.next_fire_at <= now)
                .order_by(Schedule.next_fire_at)
            ).all()
        )

    def lock(self, schedule_id: str) -> Schedule | None:
        """The schedule, row-locked; None when missing or another transaction holds it."""
        return self.session.scalars(
            select(Schedule)
            .where(Schedule.id == schedule_id)
            .with_for_update(skip_locked=True)
            .execution_options(populate_existing=True)
        ).one_or_none()

    def insert_fire(
        self,
        schedule_id: str,
        fire_time: datetime,
        status: str,
        detail: str | None = None,
    ) -> ScheduleFire | None:
        """Insert the fire row unless ``(schedule_id, fire_time)`` exists; None if it did.

        ``INSERT ... ON CONFLICT DO NOTHING``: of concurrent inserters exactly
        one gets the row (the others wait for its transaction, then get None).
        """
        fire_id = self.session.scalar(
            pg_insert(ScheduleFire)
            .values(
                id=new_id(),
                schedule_id=schedule_id,
                fire_time=fire_time,
                status=status,
                detail=detail,
            )
            .on_conflict_do_nothing(constraint="uq_schedule_fires_schedule_time")
            .returning(ScheduleFire.id)
        )
        return None if fire_id is None else self.session.get(ScheduleFire, fire_id)

    def fires(
        self, schedule_id: str, *, limit: int, offset: int
    ) -> tuple[Sequence[ScheduleFire], int]:
        """The schedule's fires, newest fire time first, and their total."""
        cond = ScheduleFire.schedule_id == schedule_id
        total = self.session.scalar(select(func.count()).select_from(ScheduleFire).where(cond))
        rows = self.session.scalars(
            select(ScheduleFire)
            .where(cond)
            .order_by(ScheduleFire.fire_time.desc())
            .limit(limit)
            .offset(offset)
        ).all()
        return rows, int(total or 0)

    def fired_before(
        self, schedule_id: str, before: datetime | None, limit: int = 20
    ) -> Sequence[ScheduleFire]:
        """Fires with an experiment (``fired``) before ``before`` (all if None), newest first."""
        conds = [
            ScheduleFire.schedule_id == schedule_id,
            ScheduleFire.status == "fired",
            ScheduleFire.experiment_id.is_not(None),
        ]
        if before is not None:
            conds.append(ScheduleFire.fire_time < before)
        return self.session.scalars(
            select(ScheduleFire).where(*conds).order_by(ScheduleFire.fire_time.desc()).limit(limit)
        ).all()

    def has_active_runs(self, experiment_id: str) -> bool:
        """Whether the experiment has a run that is not terminal."""
        return bool(
            self.session.scalar(
                select(func.count())
                .select_from(Run)
                .where(
                    Run.experiment_id == experiment_id,
                    Run.status.not_in([s.value for s in TERMINAL]),
                )
            )
        )


class TokenRepository:
    """API tokens (:class:`ApiToken`); hashing and checks live in :mod:`orchestrator.core.auth`."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, token: ApiToken) -> ApiToken:
        self.session.add(token)
        self.session.flush()
        return token

    def by_key_id(self, key_id: str) -> ApiToken | None:
        return self.session.scalar(select(ApiToken).where(ApiToken.key_id == key_id))

    def get(self, token_id: str) -> ApiToken | None:
        return self.session.get(ApiToken, token_id)

    def active_by_name(self, name: str) -> ApiToken | None:
        return self.session.scalar(
            select(ApiToken).where(ApiToken.name == name, ApiToken.revoked_at.is_(None))
        )

    def any_active(self, now: datetime) -> bool:
        """Whether a token exists that is neither revoked nor expired at ``now``."""
        return (
            self.session.scalar(
                select(ApiToken.id)
                .where(
                    ApiToken.revoked_at.is_(None),
                    or_(ApiToken.expires_at.is_(None), ApiToken.expires_at > now),
                )
                .limit(1)
            )
            is not None
        )

    def touch(self, token_id: str, now: datetime, unless_since: datetime) -> None:
        """Set ``last_used_at`` to ``now`` unless it is already at or after ``unless_since``."""
        self.session.execute(
            update(ApiToken)
            .where(
                ApiToken.id == token_id,
                or_(ApiToken.last_used_at.is_(None), ApiToken.last_used_at < unless_since),
            )
            .values(last_used_at=now)
        )

    def all(self, *, include_revoked: bool = True) -> Sequence[ApiToken]:
        """Every token, newest first."""
        q = select(ApiToken).order_by(ApiToken.created_at.desc(), ApiToken.id)
        if not include_revoked:
            q = q.where(ApiToken.revoked_at.is_(None))
        return self.session.scalars(q).all()


class WebSessionRepository:
    """Dashboard sign-ins (:class:`WebSession`), looked up by the hash of the cookie."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, web_session: WebSession) -> WebSession:
        self.session.add(web_session)
        self.session.flush()
        return web_session

    def get(self, id_hash: str) -> WebSession | None:
        return self.session.get(WebSession, id_hash)

    def delete(self, id_hash: str) -> None:
        self.session.execute(delete(WebSession).where(WebSession.id_hash == id_hash))

    def delete_for_token(self, token_id: str) -> None:
        self.session.execute(delete(WebSession).where(WebSession.token_id == token_id))

    def delete_expired(self, now: datetime) -> None:
        self.session.execute(delete(WebSession).where(WebSession.expires_at <= now))


class AuditRepository:
    """The audit trail (:class:`AuditEvent`)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(
        self,
        *,
        actor: str,
        action: str,
        target: str,
        role: str | None = None,
        token_id: str | None = None,
    ) -> None:
        self.session.add(
            AuditEvent(actor=actor, role=role, token_id=token_id, action=action, target=target)
        )

    def page(self, *, limit: int, offset: int) -> tuple[Sequence[AuditEvent], int]:
        """Events, newest first."""
        total = self.session.scalar(select(func.count()).select_from(AuditEvent)) or 0
        rows = self.session.scalars(
            select(AuditEvent)
            .order_by(AuditEvent.at.desc(), AuditEvent.id.desc())
            .limit(limit)
            .offset(offset)
        ).all()
        return rows, int(total)
