"""tenants, api keys and the request log

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("key_prefix", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked", sa.Boolean, nullable=False),
    )
    op.create_table(
        "request_log",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("route", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256)),
        sa.Column("upstream", sa.String(128)),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("stream", sa.Boolean, nullable=False),
        sa.Column("prompt_tokens", sa.Integer),
        sa.Column("completion_tokens", sa.Integer),
        sa.Column("cached_tokens", sa.Integer),
        sa.Column("ttfb_ms", sa.Float),
        sa.Column("total_ms", sa.Float, nullable=False),
        sa.Column("error_type", sa.String(64)),
    )
    op.create_index("ix_request_log_created_at", "request_log", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_request_log_created_at", table_name="request_log")
    op.drop_table("request_log")
    op.drop_table("api_keys")
    op.drop_table("tenants")
