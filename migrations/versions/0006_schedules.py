"""Scheduled sweeps: ``schedules`` and ``schedule_fires``.

Why: a schedule submits its experiment ``template`` on a cron expression (in
an IANA time zone). ``schedule_fires`` records every fire time once (UNIQUE
``(schedule_id, fire_time)``), so two orchestrators or a restart never start
the same sweep twice; the row that wins the insert creates the experiment in
the same transaction.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column("id", sa.String(length=36), primary_key=True),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("cron", sa.String(length=200), nullable=False),
        sa.Column("timezone", sa.String(length=64), nullable=False),
        sa.Column("template", JSON, nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False, server_default=sa.true()),
        sa.Column("concurrency_policy", sa.String(length=10), nullable=False),
        sa.Column("catch_up", sa.String(length=10), nullable=False),
        sa.Column("end_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("last_fire_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("next_fire_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("name", name="uq_schedules_name"),
        sa.CheckConstraint(
            "concurrency_policy IN ('skip', 'queue')", name="ck_schedules_concurrency_policy"
        ),
        sa.CheckConstraint("catch_up IN ('latest', 'none')", name="ck_schedules_catch_up"),
    )
    op.create_index("ix_schedules_due", "schedules", ["enabled", "next_fire_at"])
    op.create_table(
        "schedule_fires",
        sa.Column("id", sa.String(length=36), primary_key=True),
        sa.Column(
            "schedule_id",
            sa.String(length=36),
            sa.ForeignKey(
                "schedules.id",
                ondelete="CASCADE",
                name="fk_schedule_fires_schedule_id_schedules",
            ),
            nullable=False,
        ),
        sa.Column("fire_time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column(
            "experiment_id",
            sa.String(length=36),
            sa.ForeignKey(
                "experiments.id",
                ondelete="SET NULL",
                name="fk_schedule_fires_experiment_id_experiments",
            ),
            nullable=True,
        ),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.UniqueConstraint("schedule_id", "fire_time", name="uq_schedule_fires_schedule_time"),
        sa.CheckConstraint(
            "status IN ('fired', 'skipped', 'skipped_busy', 'failed')",
            name="ck_schedule_fires_status_valid",
        ),
    )
    op.create_index("ix_schedule_fires_experiment_id", "schedule_fires", ["experiment_id"])


def downgrade() -> None:
    op.drop_index("ix_schedule_fires_experiment_id", table_name="schedule_fires")
    op.drop_table("schedule_fires")
    op.drop_index("ix_schedules_due", table_name="schedules")
    op.drop_table("schedules")
