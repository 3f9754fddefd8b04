"""Settings of the router (`settings.routing`, env `KVGATE_ROUTING__<FIELD>`)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field


class Strategy(StrEnum):
    PREFIX = "prefix"
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"


class RoutingSettings(BaseModel):
    strategy: Strategy = Field(default=Strategy.PREFIX, description="prefix, round_robin or least_load.")
    encoding: str = Field(default="o200k_base", description="tiktoken encoding that cuts prompts into blocks.")
    block_tokens: int = Field(default=64, ge=8, description="Tokens per prefix block in the router's index.")
    index_blocks_per_upstream: int = Field(
        default=200_000, ge=0, description="Prefix blocks remembered per upstream (an LRU, like its cache)."
    )
    load_penalty_tokens: int = Field(
        default=512, ge=0, description="Cached tokens one in-flight request is worth when choosing an upstream."
    )
    health_interval_s: float = Field(default=10.0, gt=0, description="Seconds between health checks.")
    failure_threshold: int = Field(default=3, ge=1, description="Failures in a row that open the circuit.")
    cooldown_s: float = Field(default=10.0, gt=0, description="Seconds an open circuit waits before one probe.")
    connect_retries: int = Field(default=1, ge=0, description="Retries of a failed connect on the same upstream.")
