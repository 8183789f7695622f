"""Tuning campaigns: the ``campaigns`` table and each run's campaign and label.

Why: a tuning campaign (issue 25) is a stored, running thing: its request (model,
workload, starting engine arguments, objective, space, budget, decision rule), its status
and what it decided so far (``result``: path, candidates, confirmation). Its decisions are
rebuilt from its runs, so each run records the campaign that planned it and its label
there; ``(campaign_id, campaign_label)`` is unique, so an advance repeated after a restart
cannot queue a run twice.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "campaigns",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=20), server_default="queued", nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("request", postgresql.JSONB(), nullable=False),
        sa.Column("result", postgresql.JSONB(), server_default="{}", nullable=False),
        sa.Column("submitted_by", sa.String(length=200), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
            name=op.f("ck_campaigns_status_valid"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_campaigns")),
    )
    op.create_index("ix_campaigns_status", "campaigns", ["status"])
    op.create_index("ix_campaigns_created", "campaigns", ["created_at"])
    op.add_column("runs", sa.Column("campaign_id", sa.String(length=36), nullable=True))
    op.add_column("runs", sa.Column("campaign_label", sa.String(length=300), nullable=True))
    op.create_foreign_key(
        op.f("fk_runs_campaign_id_campaigns"),
        "runs",
        "campaigns",
        ["campaign_id"],
        ["id"],
        ondelete="SET NULL",
    )
    op.create_unique_constraint("uq_runs_campaign_label", "runs", ["campaign_id", "campaign_label"])


def downgrade() -> None:
    op.drop_constraint("uq_runs_campaign_label", "runs", type_="unique")
    op.drop_constraint(op.f("fk_runs_campaign_id_campaigns"), "runs", type_="foreignkey")
    op.drop_column("runs", "campaign_label")
    op.drop_column("runs", "campaign_id")
    op.drop_index("ix_campaigns_created", table_name="campaigns")
    op.drop_index("ix_campaigns_status", table_name="campaigns")
    op.drop_table("campaigns")
