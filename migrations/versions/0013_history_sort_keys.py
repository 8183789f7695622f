"""The run history at a million runs: metric sort keys kept on the run, indexes for the
history's orders.

Why: sorting the history by a summary metric joined ``run_metrics`` (one row per run
and metric) and sorted every matching run: 3.9 s at 1,000,000 runs (issue 26). The
five metrics the history sorts by are now columns of ``runs`` (``sort_*``, written with
the run's metrics by ``RunRepository.replace_measurements`` and backfilled here), each
with an index ``(column, id)`` that gives the order and the keyset cursor's tie-break.
``runs(started_at, id)`` serves the sort by start, and ``experiments(created_at, id)``
with ``runs(experiment_id, sequence, id)`` (``id`` added) the default order (the newest
experiment first, its runs together in start order), index-only for a page's ids;
``runs(<column>, id)`` for the sorts by status, model, change, sequence and duration
(``finished_at - started_at``), and
``experiments(name, id)`` for the sort by experiment (its runs together too).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: run_metrics name -> runs column (orchestrator.core.models.RUN_SORT_METRICS at 0013)
SORT_METRICS = {
    "median_ttft_ms": "sort_ttft_p50",
    "p99_ttft_ms": "sort_ttft_p99",
    "median_e2el_ms": "sort_e2el_p50",
    "output_throughput": "sort_output_throughput",
    "prefix_cache_hit_rate": "sort_hit_rate",
}

#: the history's other column sorts: index name -> runs column (each with the id tie-break)
COLUMN_SORTS = {
    "ix_runs_status_id": "status",
    "ix_runs_model_id": "model_id",
    "ix_runs_variable": "variable",
    "ix_runs_sequence": "sequence",
}


def upgrade() -> None:
    for col in SORT_METRICS.values():
        op.add_column("runs", sa.Column(col, sa.Float(), nullable=True))
    # one pass over run_metrics (pivoted), not one UPDATE per metric
    pivot = ", ".join(
        f"max(value) FILTER (WHERE name = '{name}') AS {col}" for name, col in SORT_METRICS.items()
    )
    sets = ", ".join(f"{col} = m.{col}" for col in SORT_METRICS.values())
    names = ", ".join(f"'{name}'" for name in SORT_METRICS)
    op.execute(
        f"UPDATE runs SET {sets} FROM (SELECT run_id, {pivot} FROM run_metrics "
        f"WHERE name IN ({names}) GROUP BY run_id) AS m WHERE m.run_id = runs.id"
    )
    for col in SORT_METRICS.values():
        op.create_index(f"ix_runs_{col}", "runs", [col, "id"])
    op.create_index("ix_runs_started", "runs", ["started_at", "id"])
    op.create_index("ix_experiments_created", "experiments", ["created_at", "id"])
    op.drop_index("ix_runs_experiment_sequence", table_name="runs")
    op.create_index("ix_runs_experiment_sequence", "runs", ["experiment_id", "sequence", "id"])
    for name, col in COLUMN_SORTS.items():
        op.create_index(name, "runs", [col, "id"])
    op.create_index("ix_experiments_name", "experiments", ["name", "id"])
    op.create_index("ix_runs_duration", "runs", [sa.text("(finished_at - started_at)"), "id"])


def downgrade() -> None:
    op.drop_index("ix_runs_duration", table_name="runs")
    op.drop_index("ix_experiments_name", table_name="experiments")
    for name in COLUMN_SORTS:
        op.drop_index(name, table_name="runs")
    op.drop_index("ix_runs_experiment_sequence", table_name="runs")
    op.create_index("ix_runs_experiment_sequence", "runs", ["experiment_id", "sequence"])
    op.drop_index("ix_experiments_created", table_name="experiments")
    op.drop_index("ix_runs_started", table_name="runs")
    for col in SORT_METRICS.values():
        op.drop_index(f"ix_runs_{col}", table_name="runs")
        op.drop_column("runs", col)
