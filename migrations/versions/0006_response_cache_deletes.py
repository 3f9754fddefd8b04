"""response_cache_purges.entry_id: a delete of one entry, recorded so every replica drops it

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("response_cache_purges") as batch:
        batch.add_column(sa.Column("entry_id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("response_cache_purges") as batch:
        batch.drop_column("entry_id")
