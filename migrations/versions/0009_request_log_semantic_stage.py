"""request_log.semantic_stage: how a semantic lookup ended (ruled-out, judged, variant)

The dashboard shows the semantic funnel (lookups, ruled out by the cheap stage, judged, hits, busy,
variants) over the window it shows, for every replica: the request log is where it is read, beside
`semantic_skipped` (0008) and the cache status.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-15
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.add_column(sa.Column("semantic_stage", sa.String(16)))


def downgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.drop_column("semantic_stage")
