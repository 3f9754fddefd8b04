"""Settings of the upstream package: the router (`settings.routing`, env `KVGATE_ROUTING__<FIELD>`)
and each upstream (`settings.upstreams`, or `--upstream NAME=BASE_URL`)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator


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
    route_on_kv_events: bool = Field(default=True, description="Route vLLM upstreams that publish KV events "
                                     "(kv_events) on the blocks they report; false: follow the events only to "
                                     "count misrouted requests, and route on the approximate index.")
    not_served_s: float = Field(default=300.0, ge=0, description="Seconds an upstream that answered 501 on a "
                                "route (it does not serve it) is not asked on that route.")


class UpstreamSettings(BaseModel):
    """One OpenAI-compatible backend kvgate forwards to."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    base_url: str
    api_key_env: str | None = None
    models: list[str] = Field(default_factory=list)
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    # Idle pooled connections are closed after this long: below the upstream's own keep-alive timeout
    # (uvicorn, and so vLLM and SGLang, close idle connections after 5 s), or reuse races its close.
    keepalive_timeout_s: float = Field(default=4.0, gt=0)
    inject_stream_usage: bool = True
    # A kvgate engine (`kvgate engine`): send it the tenant's KV salt so tenants keep separate blocks.
    send_cache_salt: bool = False
    # "anthropic": an Anthropic-style API (x-api-key auth); /v1/messages is forwarded to it unchanged.
    api: Literal["openai", "anthropic"] = "openai"
    # Speaks OpenAI's /v1/responses itself: Responses requests are forwarded, not translated.
    responses_api: bool = False
    # Forward prompt_cache_key and cache_salt; false for upstreams that reject fields they do not know.
    prompt_cache_fields: bool = True
    # "llama.cpp": a llama.cpp server (`llama-server`): kvgate pins conversations to its slots and
    # keeps their KV in its tiers (gateway/slots). None: recognised from the server's /props.
    # "vllm": a vLLM server; with `kv_events`, routed on the blocks it reports (gateway/vllm). None:
    # recognised from its /v1/models (`owned_by: "vllm"`).
    kind: Literal["openai", "llama.cpp", "vllm"] | None = None
    # The directory kvgate sees as this llama.cpp server's `--slot-save-path` (slot files pass there).
    slot_dir: str | None = None
    # This vLLM server's KV-event publisher (its `--kv-events-config` "endpoint", as kvgate reaches it:
    # tcp://HOST:PORT) and replay endpoint ("replay_endpoint": batches missed while disconnected).
    kv_events: str | None = None
    kv_events_replay: str | None = None

    @model_validator(mode="after")
    def _events_of_vllm(self) -> UpstreamSettings:
        if self.kv_events is not None and self.kind in ("openai", "llama.cpp"):
            raise ValueError(f"kv_events is vLLM's KV-event endpoint; upstream {self.name!r} has kind {self.kind!r}")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError(f"upstream {self.name!r}: kv_events_replay needs kv_events")
        for endpoint in (self.kv_events, self.kv_events_replay):
            if endpoint is not None and "*" in endpoint:
                raise ValueError(f"upstream {self.name!r}: {endpoint!r} is vLLM's bind address; give the "
                                 "address kvgate connects to (tcp://HOST:PORT)")
        return self

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


def with_upstream(upstreams: list[UpstreamSettings], short: UpstreamSettings) -> list[UpstreamSettings]:
    """`upstreams` with the short form `NAME=BASE_URL` (`--upstream`, `KVGATE_UPSTREAM`) merged in:
    a new name is appended; a known name gets the short form's URL and keeps the rest of its full
    form (key, models, timeouts). The one precedence rule for both sources: the short form names
    where, the full form says how."""
    for i, upstream in enumerate(upstreams):
        if upstream.name == short.name:
            return [*upstreams[:i], upstream.model_copy(update={"base_url": short.base_url}), *upstreams[i + 1:]]
    return [*upstreams, short]
