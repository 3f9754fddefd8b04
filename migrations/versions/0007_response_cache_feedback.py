"""response_cache.wrong_reports / correct_reports; response_cache_purges.semantic_only: feedback on hits

A wrong-hit report takes its entry out of semantic serving on every replica: it is recorded as a
purge row naming the entry with `semantic_only` set, which replicas read as they read deletes.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("response_cache") as batch:
        batch.add_column(sa.Column("wrong_reports", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("correct_reports", sa.Integer, nullable=False, server_default="0"))
    with op.batch_alter_table("response_cache_purges") as batch:
        batch.add_column(sa.Column("semantic_only", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("response_cache_purges") as batch:
        batch.drop_column("semantic_only")
    with op.batch_alter_table("response_cache") as batch:
        batch.drop_column("correct_reports")
        batch.drop_column("wrong_reports")
