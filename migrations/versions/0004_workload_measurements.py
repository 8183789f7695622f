"""Workload v2 measurements: partial runs, cached tokens, open-loop schedule, turns.

Why: a run that ends early (the server stopped answering) keeps what it
measured and is marked ``partial``; each request record now keeps the cached
prompt tokens the server reported, when an open-loop request was due
(``scheduled_s``) and its conversation and turn (multi-turn workloads). Older
rows keep NULL / false. ``run_requests`` gets an index for the per-class
filter of ``GET /runs/{id}/requests``.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "runs", sa.Column("partial", sa.Boolean(), server_default=sa.false(), nullable=False)
    )
    op.add_column("run_requests", sa.Column("cached_tokens", sa.Integer(), nullable=True))
    op.add_column("run_requests", sa.Column("scheduled_s", sa.Float(), nullable=True))
    op.add_column("run_requests", sa.Column("conversation", sa.Integer(), nullable=True))
    op.add_column("run_requests", sa.Column("turn", sa.Integer(), nullable=True))
    op.create_index(
        "ix_run_requests_run_class", "run_requests", ["run_id", "request_class"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_run_requests_run_class", table_name="run_requests")
    for column in ("turn", "conversation", "scheduled_s", "cached_tokens"):
        op.drop_column("run_requests", column)
    op.drop_column("runs", "partial")
