"""kvgate's one settings tree.

Every field can be set from the environment or a `.env` file with the `KVGATE_` prefix; nested
models use `__` (`KVGATE_KVCACHE__BLOCK_SIZE=16`). Every field is listed in `.env.example`.
The CLI flags of `kvgate serve` override the same fields.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gateway.canonical.settings import CanonicalSettings
from gateway.engine.settings import EngineSettings
from gateway.kvcache.settings import KVCacheSettings
from gateway.limits.settings import LimitsSettings
from gateway.observability.settings import ObservabilitySettings
from gateway.persistence.location import resolve_database_url
from gateway.persistence.settings import ResponsesSettings
from gateway.pipeline.compaction import CompactionSettings
from gateway.pipeline.settings import CondenseSettings
from gateway.responsecache.semantic.embedder import MODEL_ID
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.slots.settings import SlotSettings
from gateway.upstream.settings import RoutingSettings, UpstreamSettings, parse_upstream_flag, with_upstream
from gateway.usage.settings import Price, UsageSettings

LOCAL_EMBEDDING_MODEL_ID = MODEL_ID
__all__ = ["LOCAL_EMBEDDING_MODEL_ID", "Settings", "UpstreamSettings", "parse_upstream_flag"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVGATE_",
        env_nested_delimiter="__",
        env_file=".env",
        extra="ignore",
    )

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    # A URL or a plain SQLite file path; a SQLite path is made absolute against the working directory
    # (gateway/persistence/location.py), so every command names the file `kvgate serve` opens there.
    database_url: str = Field(default="sqlite+aiosqlite:///kvgate.db", validate_default=True)
    auto_migrate: bool = True
    # PostgreSQL pool. Background writers (request log, response-cache store) hold one connection
    # each at most, so requests keep the rest.
    db_pool_size: int = Field(default=10, ge=1)
    db_max_overflow: int = Field(default=20, ge=0)
    db_pool_timeout_s: float = Field(default=30.0, gt=0)
    no_auth: bool = False
    admin_key: str | None = None
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    upstreams: list[UpstreamSettings] = Field(default_factory=list)
    # `KVGATE_UPSTREAM=a=http://x/v1,b=http://y/v1`: the `--upstream` shorthand from the environment.
    upstream: Annotated[list[str], NoDecode] = Field(default_factory=list)
    log_level: str = "info"
    log_prompts: bool = False
    request_log_batch: int = Field(default=4096, gt=0)
    # Rows the request log holds in memory while the database is slow or down; past it rows are
    # dropped (counted: kvgate_request_log_dropped_rows_total, the dashboard's request-log tile).
    request_log_max_queue: int = Field(default=100_000, gt=0)
    # Folder of the request log's journal, where each queued row is also kept until it is committed, so
    # that a killed gateway loses none (gateway/persistence/request_journal.py); `{hostname}` is
    # replaced by the host's name (a container's own). Unset: beside a SQLite file, none on
    # PostgreSQL; "off": none.
    request_log_journal_dir: str | None = None
    key_cache_ttl_s: float = 30.0
    # Give requests with x-kvgate-session and no prompt_cache_key one derived from tenant and session.
    derive_prompt_cache_key: bool = False
    canonical: CanonicalSettings = Field(default_factory=CanonicalSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    usage: UsageSettings = Field(default_factory=UsageSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    kvcache: KVCacheSettings = Field(default_factory=KVCacheSettings)
    slots: SlotSettings = Field(default_factory=SlotSettings)  # llama.cpp slot files (gateway/slots)
    responsecache: ResponseCacheSettings = Field(default_factory=ResponseCacheSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    compaction: CompactionSettings = Field(default_factory=CompactionSettings)
    condense: CondenseSettings = Field(default_factory=CondenseSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    # Responses API answers kept for previous_response_id (gateway/persistence/responses.py).
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)

    @field_validator("database_url")
    @classmethod
    def _resolve_database_url(cls, value: str) -> str:
        return resolve_database_url(value)

    @field_validator("upstream", mode="before")
    @classmethod
    def _split_upstream(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _merge_upstream_shorthand(self) -> Settings:
        for spec in self.upstream:
            self.upstreams = with_upstream(self.upstreams, parse_upstream_flag(spec))
        self.upstream = []
        return self

    def price_for(self, model: str | None) -> Price | None:
        """The configured price of a model; the default price for other remote models; None (not
        priced) for the built-in engine's models, which run locally and cost nothing per token."""
        if model is not None and model in self.usage.prices:
            return self.usage.prices[model]
        if model in (self.engine.served_model_name, LOCAL_EMBEDDING_MODEL_ID):
            return None
        return self.usage.default_price

    def check_no_auth(self) -> None:
        """--no-auth serves everyone as one tenant: only where no one else can reach the port."""
        if self.no_auth and not self.is_loopback():
            raise ValueError(f"--no-auth is allowed only on a loopback address, not {self.host!r}")

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
