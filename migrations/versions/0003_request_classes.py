"""Request classes: each per-request record keeps its class (short / long).

Why: workloads now mix short chats and long-document questions; every metric
is also reported per class, and comparisons (long requests starving short
ones) need the class of each stored request. Older rows keep NULL.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("run_requests", sa.Column("request_class", sa.String(length=50), nullable=True))


def downgrade() -> None:
    op.drop_column("run_requests", "request_class")
