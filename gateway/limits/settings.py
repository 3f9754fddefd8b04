"""`KVGATE_LIMITS__*`: where limits are counted. The limits themselves live on keys and tenants
(`kvgate keys create|update`, `/admin/keys`).

Replicas hold one set of limits only when they count in one place: Redis (`redis_url`), else the
PostgreSQL database they share (`store` sql, what auto picks there). Counted in memory, each
gateway process counts its own requests, tokens and concurrent requests; budgets, read from the
request log, still hold across replicas within `spend_refresh_s`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator


class LimitsSettings(BaseModel):
    enabled: bool = Field(default=True, description="Enforce the limits set on keys and tenants.")
    # auto: Redis when redis_url is set, else the database when it is PostgreSQL, else this process.
    store: Literal["auto", "memory", "redis", "sql"] = "auto"
    redis_url: str | None = Field(default=None, description="Redis shared by every replica for the counts.")
    redis_prefix: str = "kvgate:limits:"
    # How often a gateway counting in memory or SQL re-reads spend from the request log (budgets across replicas).
    spend_refresh_s: float = Field(default=5.0, gt=0)

    @field_validator("redis_url", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value
