"""Placement and node parity: what each run got, and parity reports.

Why: runs are now placed across Ray nodes (TP groups inside a node, PP stages
across nodes) and, before a multi-node launch, every chosen node's
environment is compared; a mismatch blocks the run. ``runs.placement`` keeps
the layout the run got (nodes, ranks, devices, policy), ``runs.parity`` the
parity report. ``parity_checks`` holds on-demand checks
(``POST /api/v1/cluster/parity``), which the orchestrator answers.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("runs", sa.Column("placement", JSON, nullable=True))
    op.add_column("runs", sa.Column("parity", JSON, nullable=True))
    op.create_table(
        "parity_checks",
        sa.Column("id", sa.String(length=36), primary_key=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("status", sa.String(length=20), nullable=False, server_default="pending"),
        sa.Column("request", JSON, nullable=False),
        sa.Column("report", JSON, nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("claimed_by", sa.String(length=100), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'done', 'failed')", name="ck_parity_checks_status"
        ),
    )
    op.create_index("ix_parity_checks_status", "parity_checks", ["status", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_parity_checks_status", table_name="parity_checks")
    op.drop_table("parity_checks")
    op.drop_column("runs", "parity")
    op.drop_column("runs", "placement")
