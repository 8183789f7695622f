"""Models named by Hugging Face id: the snapshot commit each experiment and run resolved to.

Why: a model id (``Qwen/Qwen2.5-7B-Instruct``) names whatever its branch points to
today; the evidence must say which snapshot was measured. ``model_revision`` holds the
commit a node's Hugging Face cache resolved the id (and the spec's ``revision``) to;
NULL for model directories and generated models, which have no revision.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("experiments", sa.Column("model_revision", sa.String(64), nullable=True))
    op.add_column("runs", sa.Column("model_revision", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "model_revision")
    op.drop_column("experiments", "model_revision")
