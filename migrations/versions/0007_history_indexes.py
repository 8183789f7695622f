"""Indexes for the dashboard's run history.

Why: the history table filters by model, submission time and engine argument
and sorts by submission time or by a summary metric, over tens of thousands of
runs. ``runs(created_at)`` and ``runs(model_id, created_at)`` serve the default
order and the model filter, a GIN index on ``runs.engine_args`` serves the
``@>`` containment filter, and ``run_metrics(name, value)`` serves sorting by a
metric (see ``orchestrator/runs/history.py`` and docs/BENCHMARKS.md).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_runs_created", "runs", ["created_at"])
    op.create_index("ix_runs_model_created", "runs", ["model_id", "created_at"])
    op.create_index("ix_runs_engine_args", "runs", ["engine_args"], postgresql_using="gin")
    op.create_index("ix_run_metrics_name_value", "run_metrics", ["name", "value"])


def downgrade() -> None:
    op.drop_index("ix_run_metrics_name_value", table_name="run_metrics")
    op.drop_index("ix_runs_engine_args", table_name="runs")
    op.drop_index("ix_runs_model_created", table_name="runs")
    op.drop_index("ix_runs_created", table_name="runs")
