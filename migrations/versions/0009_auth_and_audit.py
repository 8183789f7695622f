"""Authentication and audit: ``api_tokens``, ``web_sessions``, ``audit_events`` and who
submitted, cancelled or changed experiments, runs and schedules.

Why: the API had no authentication, so anyone who reached the port could submit,
cancel anyone's runs, change schedules and read engine logs. Tokens carry a role
(viewer, operator, admin) and are stored as a salted SHA-256 of their secret;
dashboard sign-ins are server-side sessions (the cookie holds a random id, stored
hashed) that end with their token. ``submitted_by`` / ``cancelled_by`` /
``created_by`` / ``updated_by`` name the token (or ``anonymous`` for open access on
loopback, ``schedule:<name>`` for scheduled sweeps); ``audit_events`` keeps one row
per successful state-changing request. Existing rows keep NULL (unknown).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("experiments", sa.Column("submitted_by", sa.String(200), nullable=True))
    op.add_column("runs", sa.Column("submitted_by", sa.String(200), nullable=True))
    op.add_column("runs", sa.Column("cancelled_by", sa.String(200), nullable=True))
    op.add_column("schedules", sa.Column("created_by", sa.String(200), nullable=True))
    op.add_column("schedules", sa.Column("updated_by", sa.String(200), nullable=True))
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(length=36), primary_key=True),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("role", sa.String(length=20), nullable=False),
        sa.Column("salt", sa.String(length=64), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("created_by", sa.String(length=200), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_by", sa.String(length=200), nullable=True),
        sa.UniqueConstraint("key_id", name="uq_api_tokens_key_id"),
        sa.CheckConstraint(
            "role IN ('viewer', 'operator', 'admin')", name="ck_api_tokens_role_valid"
        ),
    )
    op.create_index(
        "uq_api_tokens_active_name",
        "api_tokens",
        ["name"],
        unique=True,
        postgresql_where=sa.text("revoked_at IS NULL"),
    )
    op.create_table(
        "web_sessions",
        sa.Column("id_hash", sa.String(length=64), primary_key=True),
        sa.Column(
            "token_id",
            sa.String(length=36),
            sa.ForeignKey(
                "api_tokens.id", ondelete="CASCADE", name="fk_web_sessions_token_id_api_tokens"
            ),
            nullable=False,
        ),
        sa.Column("csrf_token", sa.String(length=64), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_web_sessions_expires_at", "web_sessions", ["expires_at"])
    op.create_table(
        "audit_events",
        sa.Column("id", sa.BigInteger(), primary_key=True, autoincrement=True),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("role", sa.String(length=20), nullable=True),
        sa.Column("token_id", sa.String(length=36), nullable=True),
        sa.Column("action", sa.String(length=50), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
    )
    op.create_index("ix_audit_events_at", "audit_events", ["at"])


def downgrade() -> None:
    op.drop_index("ix_audit_events_at", table_name="audit_events")
    op.drop_table("audit_events")
    op.drop_index("ix_web_sessions_expires_at", table_name="web_sessions")
    op.drop_table("web_sessions")
    op.drop_index("uq_api_tokens_active_name", table_name="api_tokens")
    op.drop_table("api_tokens")
    op.drop_column("schedules", "updated_by")
    op.drop_column("schedules", "created_by")
    op.drop_column("runs", "cancelled_by")
    op.drop_column("runs", "submitted_by")
    op.drop_column("experiments", "submitted_by")
