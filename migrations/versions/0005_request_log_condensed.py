"""request_log.condensed_from_tokens (prompt size before the small model condensed it)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.add_column(sa.Column("condensed_from_tokens", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.drop_column("condensed_from_tokens")
