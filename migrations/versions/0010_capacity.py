"""Capacity under SLOs: a run's capacity search (its steps and the boundary it found).

Why: a run with ``capacity`` in its spec measures load steps on one server and finds
the highest load that meets every objective; ``runs.capacity`` keeps the whole search
(:class:`jobs.capacity.search.CapacityResult`: status, capacity, bracket, binding SLO and
every step's percentiles, goodput, signals and verdict) so the latency-vs-load curve
and the comparison read it back. NULL for runs without a capacity search.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("capacity", postgresql.JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "capacity")
