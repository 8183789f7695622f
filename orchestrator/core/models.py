"""SQLAlchemy 2 typed models (the schema lives in Alembic migrations).

Tables: ``experiments``, ``runs`` (one row per run, its full resolved
configuration and state), ``run_metrics`` (summary numbers, one row per metric
name), ``run_samples`` (the ``/metrics`` time series), ``run_requests``
(per-request client timings) and ``run_logs`` (the whole engine log).
``api_tokens``, ``web_sessions`` and ``audit_events`` hold authentication and the
audit trail (:mod:`orchestrator.core.auth`). ``campaigns`` are tuning campaigns; a
campaign's runs carry ``campaign_id`` and ``campaign_label``.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JSONType = JSON().with_variant(JSONB(), "postgresql")
#: A JSON column where Python None is SQL NULL (not JSON ``null``).
NullableJSON = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


def new_id() -> str:
    return str(uuid.uuid4())


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Experiment(Base):
    __tablename__ = "experiments"
    __table_args__ = (
        Index("ix_experiments_created", "created_at", "id"),
        Index("ix_experiments_name", "name", "id"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200))
    description: Mapped[str | None] = mapped_column(Text)
    spec: Mapped[dict[str, Any]] = mapped_column(JSONType)
    model_id: Mapped[str] = mapped_column(String(500))
    model_digest: Mapped[str] = mapped_column(String(64))
    model_revision: Mapped[str | None] = mapped_column(
        String(64), doc="Hugging Face snapshot commit of a model named by id"
    )
    request_list_hash: Mapped[str] = mapped_column(String(64))
    repeats: Mapped[int] = mapped_column(Integer, server_default="1")
    variants: Mapped[list[dict[str, Any]]] = mapped_column(
        JSONType, server_default="[]", doc="the chain: name, reference, variable, changes"
    )
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    submitted_by: Mapped[str | None] = mapped_column(
        String(200), doc="who submitted it: a token name, 'anonymous' or 'schedule:<name>'"
    )

    runs: Mapped[list[Run]] = relationship(
        back_populates="experiment", order_by="Run.position", lazy="selectin"
    )


#: The summary metrics the run history sorts by (``run_metrics`` name -> column of
#: ``runs``): kept on the run itself, written with its metrics
#: (``RunRepository.replace_measurements``), each with an index ``(column, id)``, so a
#: sort by a metric walks one index instead of joining ``run_metrics`` (migration 0013).
RUN_SORT_METRICS: dict[str, str] = {
    "median_ttft_ms": "sort_ttft_p50",
    "p99_ttft_ms": "sort_ttft_p99",
    "median_e2el_ms": "sort_e2el_p50",
    "output_throughput": "sort_output_throughput",
    "prefix_cache_hit_rate": "sort_hit_rate",
}


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        Index("ix_runs_status_created", "status", "created_at"),
        Index("ix_runs_experiment_position", "experiment_id", "position"),
        Index("ix_runs_experiment_sequence", "experiment_id", "sequence", "id"),
        Index("ix_runs_created", "created_at"),
        Index("ix_runs_model_created", "model_id", "created_at"),
        Index("ix_runs_engine_args", "engine_args", postgresql_using="gin"),
        Index("ix_runs_started", "started_at", "id"),
        # the history's other column sorts, each with the id tie-break of its cursor
        Index("ix_runs_status_id", "status", "id"),
        Index("ix_runs_model_id", "model_id", "id"),
        Index("ix_runs_variable", "variable", "id"),
        Index("ix_runs_sequence", "sequence", "id"),
        Index("ix_runs_duration", text("(finished_at - started_at)"), "id"),
        *(Index(f"ix_runs_{col}", col, "id") for col in RUN_SORT_METRICS.values()),
        UniqueConstraint("campaign_id", "campaign_label", name="uq_runs_campaign_label"),
        CheckConstraint(
            "status IN ('queued', 'preparing', 'running', 'succeeded', 'failed', "
            "'cancelled', 'blocked')",
            name="status_valid",
        ),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    experiment_id: Mapped[str] = mapped_column(
        ForeignKey("experiments.id", ondelete="CASCADE"), index=False
    )
    name: Mapped[str] = mapped_column(String(200))
    position: Mapped[int] = mapped_column(Integer)
    is_baseline: Mapped[bool] = mapped_column(Boolean, default=False)
    reference_run_id: Mapped[str | None] = mapped_column(String(36))
    changes: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    repeat_index: Mapped[int] = mapped_column(Integer, server_default="0")
    sequence: Mapped[int] = mapped_column(Integer, server_default="0", doc="execution order")
    reference_variant: Mapped[str | None] = mapped_column(String(200))
    variable: Mapped[str | None] = mapped_column(String(200))
    variable_paths: Mapped[list[str]] = mapped_column(JSONType, server_default="[]")
    server_key: Mapped[str | None] = mapped_column(String(64))
    resolved_config: Mapped[dict[str, Any] | None] = mapped_column(
        JSONType, doc="the configuration vLLM resolved (after its own defaults)"
    )

    status: Mapped[str] = mapped_column(String(20), default="queued")
    status_reason: Mapped[str | None] = mapped_column(Text)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    submitted_by: Mapped[str | None] = mapped_column(
        String(200), doc="who queued it (the experiment's submitter, or who added the variant)"
    )
    cancelled_by: Mapped[str | None] = mapped_column(String(200), doc="who asked to cancel it")
    claimed_by: Mapped[str | None] = mapped_column(String(100))
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    progress: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)

    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    claimed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    engine_args: Mapped[dict[str, Any]] = mapped_column(JSONType)
    explicit_engine_args: Mapped[dict[str, Any]] = mapped_column(JSONType)
    layout: Mapped[dict[str, Any]] = mapped_column(JSONType)
    workload: Mapped[dict[str, Any]] = mapped_column(JSONType)
    model_id: Mapped[str] = mapped_column(String(500))
    model_path: Mapped[str] = mapped_column(Text)
    model_digest: Mapped[str] = mapped_column(String(64))
    model_revision: Mapped[str | None] = mapped_column(
        String(64), doc="Hugging Face snapshot commit of a model named by id"
    )
    max_model_len: Mapped[int | None] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(Integer)
    request_list_hash: Mapped[str] = mapped_column(String(64))
    vllm_version: Mapped[str | None] = mapped_column(String(100))
    engine_info: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    timings: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    capacity: Mapped[dict[str, Any] | None] = mapped_column(
        JSONType,
        doc="the capacity search (jobs.capacity.search.CapacityResult), when the run had one",
    )
    error: Mapped[str | None] = mapped_column(Text)
    partial: Mapped[bool] = mapped_column(
        Boolean, default=False, server_default="false", doc="ended early; measurements kept"
    )
    placement: Mapped[dict[str, Any] | None] = mapped_column(
        JSONType, doc="the layout the run got: nodes, ranks, devices, policy"
    )
    parity: Mapped[dict[str, Any] | None] = mapped_column(
        JSONType, doc="node parity report of a multi-node launch (orchestrator.cluster.parity)"
    )

    campaign_id: Mapped[str | None] = mapped_column(
        ForeignKey("campaigns.id", ondelete="SET NULL"),
        doc="the tuning campaign that planned this run, if any",
    )
    campaign_label: Mapped[str | None] = mapped_column(
        String(300), doc="the run's label in its campaign (its idempotency key there)"
    )

    # the run history's sort keys: copies of RUN_SORT_METRICS's metrics (None until stored)
    sort_ttft_p50: Mapped[float | None] = mapped_column(Float)
    sort_ttft_p99: Mapped[float | None] = mapped_column(Float)
    sort_e2el_p50: Mapped[float | None] = mapped_column(Float)
    sort_output_throughput: Mapped[float | None] = mapped_column(Float)
    sort_hit_rate: Mapped[float | None] = mapped_column(Float)

    experiment: Mapped[Experiment] = relationship(back_populates="runs")


class Campaign(Base):
    """A tuning campaign (issue 25): ``request`` is the submitted document
    (:class:`orchestrator.tuning.campaign_request.CampaignRequest`), ``result`` what the
    campaign decided so far (path, candidates, confirmation, its runs by label), rewritten
    on every advance. Its runs point back with ``runs.campaign_id``; the decisions are
    rebuilt from them (:mod:`orchestrator.tuning.service`)."""

    __tablename__ = "campaigns"
    __table_args__ = (
        CheckConstraint(
            "status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
            name="status_valid",
        ),
        Index("ix_campaigns_status", "status"),
        Index("ix_campaigns_created", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20), default="queued", server_default="queued")
    status_reason: Mapped[str | None] = mapped_column(Text)
    request: Mapped[dict[str, Any]] = mapped_column(JSONType)
    result: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict, server_default="{}")
    submitted_by: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class RunMetric(Base):
    __tablename__ = "run_metrics"
    __table_args__ = (Index("ix_run_metrics_name_value", "name", "value"),)

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    value: Mapped[float] = mapped_column(Float)


class RunSample(Base):
    __tablename__ = "run_samples"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    t_s: Mapped[float] = mapped_column(Float)
    phase: Mapped[str] = mapped_column(String(10))
    values: Mapped[dict[str, Any]] = mapped_column(JSONType)


class RunRequest(Base):
    __tablename__ = "run_requests"
    __table_args__ = (Index("ix_run_requests_run_class", "run_id", "request_class"),)

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    request_index: Mapped[int] = mapped_column(Integer)
    warmup: Mapped[bool] = mapped_column(Boolean)
    request_class: Mapped[str | None] = mapped_column(String(50))
    success: Mapped[bool] = mapped_column(Boolean)
    error: Mapped[str | None] = mapped_column(Text)
    start_s: Mapped[float] = mapped_column(Float)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    tpot_s: Mapped[float | None] = mapped_column(Float)
    e2el_s: Mapped[float | None] = mapped_column(Float)
    itl_s: Mapped[list[float]] = mapped_column(JSONType, default=list)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    scheduled_s: Mapped[float | None] = mapped_column(Float)
    conversation: Mapped[int | None] = mapped_column(Integer)
    turn: Mapped[int | None] = mapped_column(Integer)


class RunLog(Base):
    __tablename__ = "run_logs"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    content: Mapped[str] = mapped_column(Text)


class ParityCheck(Base):
    """An on-demand node parity check (``POST /api/v1/cluster/parity``).

    The API stores the request ``pending``; an orchestrator claims it
    (``running``), probes the nodes through Ray and stores the report
    (``done``) or the reason it could not (``failed``).
    """

    __tablename__ = "parity_checks"
    __table_args__ = (
        CheckConstraint(
            "status IN ('pending', 'running', 'done', 'failed')", name="ck_parity_checks_status"
        ),
        Index("ix_parity_checks_status", "status", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    status: Mapped[str] = mapped_column(String(20), default="pending", server_default="pending")
    request: Mapped[dict[str, Any]] = mapped_column(JSONType)
    report: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    error: Mapped[str | None] = mapped_column(Text)
    claimed_by: Mapped[str | None] = mapped_column(String(100))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Orchestrator(Base):
    """A live orchestrator process and the cluster resources it sees (heartbeat)."""

    __tablename__ = "orchestrators"

    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    resources: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)


class Schedule(Base):
    """A recurring sweep: an experiment spec (``template``) submitted on a cron schedule,
    or a recurring tuning campaign: a campaign request (``campaign``) started on it
    (exactly one of the two is set).

    ``cron`` is a 5-field expression evaluated in ``timezone`` (IANA name).
    ``next_fire_at`` (UTC) is the first fire time not handled yet, or None when
    ``end_at`` has passed; the dispatcher only looks at enabled schedules whose
    ``next_fire_at`` is due. ``last_fire_at`` is the latest fire time handled.
    """

    __tablename__ = "schedules"
    __table_args__ = (
        CheckConstraint("concurrency_policy IN ('skip', 'queue')", name="concurrency_policy"),
        CheckConstraint("catch_up IN ('latest', 'none')", name="catch_up"),
        CheckConstraint("(template IS NULL) <> (campaign IS NULL)", name="template_or_campaign"),
        Index("ix_schedules_due", "enabled", "next_fire_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    cron: Mapped[str] = mapped_column(String(200))
    timezone: Mapped[str] = mapped_column(String(64))
    template: Mapped[dict[str, Any] | None] = mapped_column(NullableJSON)
    campaign: Mapped[dict[str, Any] | None] = mapped_column(NullableJSON)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, server_default="true")
    concurrency_policy: Mapped[str] = mapped_column(String(10), default="skip")
    catch_up: Mapped[str] = mapped_column(String(10), default="latest")
    end_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    created_by: Mapped[str | None] = mapped_column(String(200))
    updated_by: Mapped[str | None] = mapped_column(String(200))
    last_fire_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    next_fire_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ScheduleFire(Base):
    """One fire time of a schedule and what happened (exactly one row per fire time).

    ``status``: ``fired`` (``experiment_id`` is the sweep, or ``campaign_id`` the
    campaign a campaign schedule started), ``skipped`` (an older
    missed fire time passed over by catch-up), ``skipped_busy`` (the previous
    sweep still had unfinished runs and the policy is ``skip``) or ``failed``
    (the template no longer validates; ``detail`` says why).
    """

    __tablename__ = "schedule_fires"
    __table_args__ = (
        UniqueConstraint("schedule_id", "fire_time", name="uq_schedule_fires_schedule_time"),
        CheckConstraint(
            "status IN ('fired', 'skipped', 'skipped_busy', 'failed')", name="status_valid"
        ),
        Index("ix_schedule_fires_experiment_id", "experiment_id"),
        Index("ix_schedule_fires_campaign_id", "campaign_id"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    schedule_id: Mapped[str] = mapped_column(ForeignKey("schedules.id", ondelete="CASCADE"))
    fire_time: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    status: Mapped[str] = mapped_column(String(20))
    experiment_id: Mapped[str | None] = mapped_column(
        ForeignKey("experiments.id", ondelete="SET NULL")
    )
    campaign_id: Mapped[str | None] = mapped_column(ForeignKey("campaigns.id", ondelete="SET NULL"))
    detail: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class ApiToken(Base):
    """An API token (``vlab token create``): a name, a role and the salted hash of its secret.

    The token a client sends is ``vlab_<key_id>_<secret>``: ``key_id`` finds the row,
    ``secret_hash`` = SHA-256 of ``salt`` + secret (:mod:`orchestrator.core.auth`). The
    secret itself is never stored. A revoked or expired token authenticates nothing;
    names are unique among tokens not revoked.
    """

    __tablename__ = "api_tokens"
    __table_args__ = (
        CheckConstraint("role IN ('viewer', 'operator', 'admin')", name="role_valid"),
        Index(
            "uq_api_tokens_active_name",
            "name",
            unique=True,
            postgresql_where=text("revoked_at IS NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    key_id: Mapped[str] = mapped_column(String(32), unique=True)
    name: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(20))
    salt: Mapped[str] = mapped_column(String(64))
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    created_by: Mapped[str | None] = mapped_column(String(200))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_by: Mapped[str | None] = mapped_column(String(200))


class WebSession(Base):
    """A dashboard sign-in: the HttpOnly cookie holds a random id whose SHA-256 is
    ``id_hash``; ``csrf_token`` is the synchronizer token the pages send back in the
    ``X-CSRF-Token`` header. Ends at ``expires_at``, at sign-out, or when its token is
    revoked (the row goes with the token)."""

    __tablename__ = "web_sessions"
    __table_args__ = (Index("ix_web_sessions_expires_at", "expires_at"),)

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[str] = mapped_column(ForeignKey("api_tokens.id", ondelete="CASCADE"))
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    token: Mapped[ApiToken] = relationship(lazy="joined")


class AuditEvent(Base):
    """Who changed what: one row per successful state-changing API request (``action``
    is the HTTP method, ``target`` the path) and per token created or revoked from the
    command line (``token.create``, ``token.revoke``)."""

    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_at", "at"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    actor: Mapped[str] = mapped_column(String(200))
    role: Mapped[str | None] = mapped_column(String(20))
    token_id: Mapped[str | None] = mapped_column(String(36))
    action: Mapped[str] = mapped_column(String(50))
    target: Mapped[str] = mapped_column(Text)
