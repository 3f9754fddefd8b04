"""Limits counted in the database, for replicas that share PostgreSQL without Redis

`limit_counts` holds each limited key's and tenant's admitted requests and charged tokens per clock
minute; `limit_leases` the requests admitted under a concurrency limit and not finished yet, until
they expire. Both hold only the last few minutes (gateway/limits/sql_counters.py deletes the rest).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "limit_counts",
        sa.Column("scope", sa.String(160), primary_key=True),
        sa.Column("minute", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("requests", sa.Integer, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "limit_leases",
        sa.Column("scope", sa.String(160), primary_key=True),
        sa.Column("lease", sa.String(32), primary_key=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("limit_leases")
    op.drop_table("limit_counts")
