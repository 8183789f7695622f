"""Scheduled campaigns: a schedule may hold a campaign request; a fire records its campaign.

Why: a tuning campaign re-run on a cron schedule (issue 25, "a scheduled campaign
re-tunes and says when the best configuration moved"). A schedule holds either an
experiment ``template`` (a scheduled sweep) or a ``campaign`` request, never both
(CHECK); a fire of a campaign schedule records the campaign it started
(``schedule_fires.campaign_id``), so the final configuration of each fired campaign can
be compared with the previous one's.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.alter_column("schedules", "template", existing_type=postgresql.JSONB(), nullable=True)
    op.add_column("schedules", sa.Column("campaign", postgresql.JSONB(), nullable=True))
    op.create_check_constraint(
        op.f("ck_schedules_template_or_campaign"),
        "schedules",
        "(template IS NULL) <> (campaign IS NULL)",
    )
    op.add_column("schedule_fires", sa.Column("campaign_id", sa.String(length=36), nullable=True))
    op.create_foreign_key(
        op.f("fk_schedule_fires_campaign_id_campaigns"),
        "schedule_fires",
        "campaigns",
        ["campaign_id"],
        ["id"],
        ondelete="SET NULL",
    )
    op.create_index("ix_schedule_fires_campaign_id", "schedule_fires", ["campaign_id"])


def downgrade() -> None:
    op.drop_index("ix_schedule_fires_campaign_id", table_name="schedule_fires")
    op.drop_constraint(
        op.f("fk_schedule_fires_campaign_id_campaigns"), "schedule_fires", type_="foreignkey"
    )
    op.drop_column("schedule_fires", "campaign_id")
    op.execute("DELETE FROM schedules WHERE template IS NULL")
    op.drop_constraint(op.f("ck_schedules_template_or_campaign"), "schedules", type_="check")
    op.drop_column("schedules", "campaign")
    op.alter_column("schedules", "template", existing_type=postgresql.JSONB(), nullable=False)
