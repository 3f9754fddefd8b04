"""request_log.semantic_skipped: why a miss got no semantic lookup (busy, sampling, ...)

The dashboard shows the share of lookups the semantic cache skipped `busy` (its CPU budget spent)
beside the semantic hit rate, over the window it shows, for every replica: the request log is where
both are read.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-14
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.add_column(sa.Column("semantic_skipped", sa.String(32)))


def downgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.drop_column("semantic_skipped")
