"""request_log.cache_creation_tokens (prompt tokens written to a KV cache)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.add_column(sa.Column("cache_creation_tokens", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.drop_column("cache_creation_tokens")
