"""response cache entries and purges; request_log.cache

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade() -> None:
    op.create_table(
        "response_cache",
        sa.Column("id", _ID, primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("namespace", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("exact_key", sa.String(64), nullable=False),
        sa.Column("partition", sa.String(64)),
        sa.Column("query", sa.Text),
        sa.Column("embedding", sa.LargeBinary),
        sa.Column("answer", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("hit_count", sa.Integer, nullable=False),
    )
    op.create_index("ix_response_cache_exact_key", "response_cache", ["exact_key"])
    op.create_index("ix_response_cache_expires_at", "response_cache", ["expires_at"])
    op.create_index("ix_response_cache_scope", "response_cache", ["tenant", "namespace", "model"])
    op.create_table(
        "response_cache_purges",
        sa.Column("id", _ID, primary_key=True),
        sa.Column("tenant", sa.String(128)),
        sa.Column("namespace", sa.String(128)),
        sa.Column("model", sa.String(256)),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table("request_log") as batch:
        batch.add_column(sa.Column("cache", sa.String(16)))


def downgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.drop_column("cache")
    op.drop_table("response_cache_purges")
    op.drop_index("ix_response_cache_scope", table_name="response_cache")
    op.drop_index("ix_response_cache_expires_at", table_name="response_cache")
    op.drop_index("ix_response_cache_exact_key", table_name="response_cache")
    op.drop_table("response_cache")
