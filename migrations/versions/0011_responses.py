"""Stored Responses API answers

`responses` keeps each `store: true` answer of `POST /v1/responses` per tenant until it expires: the
response object (`GET /v1/responses/{id}`), the request's input items, and what a request naming it
in `previous_response_id` continues: the conversation items its upstream does not hold, and, for an
upstream that speaks the Responses API, which upstream holds the rest and under which id.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-09
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("tenant", sa.String(128), primary_key=True),
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("previous_response_id", sa.String(128)),
        sa.Column("upstream", sa.String(128)),
        sa.Column("upstream_response_id", sa.String(128)),
        sa.Column("input", sa.LargeBinary, nullable=False),
        sa.Column("items", sa.LargeBinary, nullable=False),
        sa.Column("response", sa.LargeBinary, nullable=False),
    )
    op.create_index("ix_responses_expires_at", "responses", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_responses_expires_at", table_name="responses")
    op.drop_table("responses")
