"""Experiment design: repeats, the variant chain, resolved configs, orchestrator heartbeats.

Why: every variant now runs N interleaved repeats (``runs.repeat_index`` and
``runs.sequence``, the execution order), is compared with a named reference
variant through one declared variable (``reference_variant``, ``variable``,
``variable_paths``), may share a vLLM server with runs that differ only in
client-side settings (``server_key``), and stores the configuration vLLM
itself resolved (``resolved_config``). Experiments keep the chain of
variants and their repeat count. ``orchestrators`` holds each live
orchestrator's heartbeat and the cluster resources it sees, so the API (which
never imports Ray) can refuse layouts the cluster cannot hold. Existing runs
keep their order: ``sequence`` is set from ``position``.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "orchestrators",
        sa.Column("id", sa.String(length=100), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column(
            "started_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "resources",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_orchestrators")),
    )
    op.add_column(
        "experiments", sa.Column("repeats", sa.Integer(), server_default="1", nullable=False)
    )
    op.add_column(
        "experiments",
        sa.Column(
            "variants",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            server_default="[]",
            nullable=False,
        ),
    )
    op.add_column(
        "runs", sa.Column("repeat_index", sa.Integer(), server_default="0", nullable=False)
    )
    op.add_column("runs", sa.Column("sequence", sa.Integer(), server_default="0", nullable=False))
    op.add_column("runs", sa.Column("reference_variant", sa.String(length=200), nullable=True))
    op.add_column("runs", sa.Column("variable", sa.String(length=200), nullable=True))
    op.add_column(
        "runs",
        sa.Column(
            "variable_paths",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            server_default="[]",
            nullable=False,
        ),
    )
    op.add_column("runs", sa.Column("server_key", sa.String(length=64), nullable=True))
    op.add_column(
        "runs",
        sa.Column(
            "resolved_config",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
    )
    op.execute("UPDATE runs SET sequence = position")
    op.create_index(
        "ix_runs_experiment_sequence", "runs", ["experiment_id", "sequence"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_runs_experiment_sequence", table_name="runs")
    op.drop_column("runs", "resolved_config")
    op.drop_column("runs", "server_key")
    op.drop_column("runs", "variable_paths")
    op.drop_column("runs", "variable")
    op.drop_column("runs", "reference_variant")
    op.drop_column("runs", "sequence")
    op.drop_column("runs", "repeat_index")
    op.drop_column("experiments", "variants")
    op.drop_column("experiments", "repeats")
    op.drop_table("orchestrators")
