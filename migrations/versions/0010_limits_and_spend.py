"""Limits and budgets on keys and tenants; who spent what in the request log

`api_keys` and `tenants` get requests and tokens per minute, concurrent requests, and a spend budget
(USD) per period; null means no limit. `budget_started_at` anchors the budget's periods (a 30-day
budget set on the 5th renews on the 5th). The request log gets the key that made the request (its
12-character prefix, what `kvgate keys list` shows) and what the request cost and saved at the
configured prices, so spend can be read per key, tenant, model and day, and budgets summed from it.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

LIMIT_COLUMNS = ("rpm_limit", "tpm_limit", "max_parallel", "budget_usd", "budget_period_s", "budget_started_at")


def _limit_columns() -> list[sa.Column]:
    return [sa.Column("rpm_limit", sa.Integer), sa.Column("tpm_limit", sa.Integer),
            sa.Column("max_parallel", sa.Integer), sa.Column("budget_usd", sa.Float),
            sa.Column("budget_period_s", sa.Integer), sa.Column("budget_started_at", sa.DateTime(timezone=True))]


def upgrade() -> None:
    for table in ("api_keys", "tenants"):
        with op.batch_alter_table(table) as batch:
            for column in _limit_columns():
                batch.add_column(column)
    with op.batch_alter_table("request_log") as batch:
        batch.add_column(sa.Column("key_prefix", sa.String(16)))
        batch.add_column(sa.Column("cost_usd", sa.Float))
        batch.add_column(sa.Column("saved_usd", sa.Float))
    op.create_index("ix_request_log_key_created", "request_log", ["key_prefix", "created_at"])
    op.create_index("ix_request_log_tenant_created", "request_log", ["tenant", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_request_log_tenant_created", table_name="request_log")
    op.drop_index("ix_request_log_key_created", table_name="request_log")
    with op.batch_alter_table("request_log") as batch:
        for name in ("saved_usd", "cost_usd", "key_prefix"):
            batch.drop_column(name)
    for table in ("tenants", "api_keys"):
        with op.batch_alter_table(table) as batch:
            for name in reversed(LIMIT_COLUMNS):
                batch.drop_column(name)
