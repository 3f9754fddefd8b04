"""kvgate's one settings tree.

Every field can be set from the environment or a `.env` file with the `KVGATE_` prefix; nested
models use `__` (`KVGATE_KVCACHE__BLOCK_SIZE=16`). Every field is listed in `.env.example`.
The CLI flags of `kvgate serve` override the same fields.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gateway.canonical.settings import CanonicalSettings
from gateway.engine.settings import EngineSettings
from gateway.kvcache.settings import KVCacheSettings
from gateway.observability.settings import ObservabilitySettings
from gateway.pipeline.compaction import CompactionSettings
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.upstream.settings import RoutingSettings
from gateway.usage.settings import Price, UsageSettings

# The model id of the embedded default's `/v1/embeddings` (gateway/engine/embeddings.py imports it
# from here: that module imports torch, this one must not).
LOCAL_EMBEDDING_MODEL_ID = "all-minilm-l6-v2"


class UpstreamSettings(BaseModel):
    """One OpenAI-compatible backend kvgate forwards to."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    base_url: str
    api_key_env: str | None = None
    models: list[str] = Field(default_factory=list)
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    inject_stream_usage: bool = True
    # A kvgate engine (`kvgate engine`): send it the tenant's KV salt so tenants keep separate blocks.
    send_cache_salt: bool = False

    @field_validator("base_url")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {value!r}")
        return value.rstrip("/")


def parse_upstream_flag(spec: str) -> UpstreamSettings:
    """Parse `NAME=BASE_URL` (the `--upstream` flag) into an upstream."""
    name, sep, url = spec.partition("=")
    if not sep or not name or not url:
        raise ValueError(f"--upstream expects NAME=BASE_URL, got {spec!r}")
    return UpstreamSettings(name=name, base_url=url)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVGATE_",
        env_nested_delimiter="__",
        env_file=".env",
        extra="ignore",
    )

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    database_url: str = "sqlite+aiosqlite:///kvgate.db"
    auto_migrate: bool = True
    no_auth: bool = False
    admin_key: str | None = None
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    upstreams: list[UpstreamSettings] = Field(default_factory=list)
    # `KVGATE_UPSTREAM=a=http://x/v1,b=http://y/v1`: the `--upstream` shorthand from the environment.
    upstream: Annotated[list[str], NoDecode] = Field(default_factory=list)
    log_level: str = "info"
    log_prompts: bool = False
    request_log_batch: int = Field(default=256, gt=0)
    key_cache_ttl_s: float = 30.0
    canonical: CanonicalSettings = Field(default_factory=CanonicalSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    usage: UsageSettings = Field(default_factory=UsageSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    kvcache: KVCacheSettings = Field(default_factory=KVCacheSettings)
    responsecache: ResponseCacheSettings = Field(default_factory=ResponseCacheSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    compaction: CompactionSettings = Field(default_factory=CompactionSettings)

    @field_validator("upstream", mode="before")
    @classmethod
    def _split_upstream(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _merge_upstream_shorthand(self) -> Settings:
        known = {u.name for u in self.upstreams}
        for spec in self.upstream:
            parsed = parse_upstream_flag(spec)
            if parsed.name not in known:
                self.upstreams.append(parsed)
                known.add(parsed.name)
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

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
