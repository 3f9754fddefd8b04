"""request_log.refusal: why the gateway refused a request (auth, requests, tokens, parallel, budget)

A request refused by its key (401) or by a limit or budget (429) was only a Prometheus counter, so
`kvgate stats` and the dashboard, which read the request log, showed none. Refused requests are now
rows of their own, with the reason here; null for a request the gateway admitted.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-17
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.add_column(sa.Column("refusal", sa.String(16)))


def downgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.drop_column("refusal")
