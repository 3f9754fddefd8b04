"""SQLAlchemy 2.0 models: the source of truth for tenants, keys and the request log."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class LimitColumns:
    """The limits a key or a tenant can have (null: none; gateway/limits/policy.py). Requests and
    tokens per minute, concurrent requests, and a spend budget in USD per `budget_period_s` (null:
    for the key's whole life) counted from `budget_started_at`."""

    rpm_limit: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tpm_limit: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_parallel: Mapped[int | None] = mapped_column(Integer, nullable=True)
    budget_usd: Mapped[float | None] = mapped_column(Float, nullable=True)
    budget_period_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    budget_started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Tenant(LimitColumns, Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ApiKey(LimitColumns, Base):
    """A gateway key, stored as its SHA-256: keys are 256-bit random, so a slow hash buys nothing."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    key_prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    # Null: never expires.
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # An admin key opens /dashboard and /admin like KVGATE_ADMIN_KEY (the first start creates one).
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)


class RequestLog(Base):
    __tablename__ = "request_log"
    __table_args__ = (Index("ix_request_log_created_at", "created_at"),
                      Index("ix_request_log_key_created", "key_prefix", "created_at"),
                      Index("ix_request_log_tenant_created", "tenant", "created_at"))

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    tenant: Mapped[str] = mapped_column(String(128))
    route: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(256))
    upstream: Mapped[str | None] = mapped_column(String(128))
    status: Mapped[int] = mapped_column(Integer)
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    # Prompt tokens written to a KV cache (`usage.cache_creation_input_tokens`); null when not reported.
    cache_creation_tokens: Mapped[int | None] = mapped_column(Integer)
    ttfb_ms: Mapped[float | None] = mapped_column(Float)
    total_ms: Mapped[float] = mapped_column(Float)
    error_type: Mapped[str | None] = mapped_column(String(64))
    # Which response cache answered: hit-exact, hit-semantic, miss, bypass; null when not cacheable.
    cache: Mapped[str | None] = mapped_column(String(16))
    # Prompt tokens the upstream would have read without condensing; null when nothing was condensed.
    condensed_from_tokens: Mapped[int | None] = mapped_column(Integer)
    # Why a miss got no semantic lookup (`x-kvgate-semantic-skipped`: busy, sampling, trivial, ...).
    semantic_skipped: Mapped[str | None] = mapped_column(String(32))
    # How a miss's or a semantic hit's semantic lookup ended (`x-kvgate-semantic-stage`: ruled-out,
    # judged, variant); null when it had none.
    semantic_stage: Mapped[str | None] = mapped_column(String(16))
    # The key that made the request (its 12-character prefix, as `kvgate keys list` shows it); null
    # for the admin key from the environment and for --no-auth.
    key_prefix: Mapped[str | None] = mapped_column(String(16))
    # What the request cost and what the caches saved, at the configured prices (usage/accounting.py);
    # null when its model is not priced. A response-cache hit costs 0.
    cost_usd: Mapped[float | None] = mapped_column(Float)
    saved_usd: Mapped[float | None] = mapped_column(Float)
    # Why the gateway refused the request before any upstream saw it (request_log.RefusalReason: auth,
    # requests, tokens, parallel, budget); null for a request it admitted.
    refusal: Mapped[str | None] = mapped_column(String(16))


class ResponseCacheEntry(Base):
    """One cached answer. `exact_key` and `partition` are SHA-256 digests (responsecache/keys.py);
    `partition` and `query` are null for answers only the exact cache may serve; `embedding` is null
    until a lookup first needs it (the semantic cache embeds stored questions on demand)."""

    __tablename__ = "response_cache"
    __table_args__ = (
        Index("ix_response_cache_exact_key", "exact_key"),
        Index("ix_response_cache_expires_at", "expires_at"),
        Index("ix_response_cache_scope", "tenant", "namespace", "model"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    namespace: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(256))
    exact_key: Mapped[str] = mapped_column(String(64))
    partition: Mapped[str | None] = mapped_column(String(64))
    query: Mapped[str | None] = mapped_column(Text)
    embedding: Mapped[bytes | None] = mapped_column(LargeBinary)
    answer: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    hit_count: Mapped[int] = mapped_column(Integer, default=0)
    # Clients' verdicts on hits of this entry (`POST /v1/kvgate/feedback`); one wrong report takes
    # the entry out of semantic serving (responsecache/semantic/feedback.py).
    wrong_reports: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    correct_reports: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class ResponseCachePurge(Base):
    """An admin purge or delete, kept so that every replica can drop the same entries from memory:
    replicas read new purges by id, the way they read new entries. A null column matches
    everything; a row with `entry_id` names one deleted entry and matches nothing else, or, with
    `semantic_only`, one entry reported as a wrong hit: it stays, served by its exact key only."""

    __tablename__ = "response_cache_purges"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    tenant: Mapped[str | None] = mapped_column(String(128))
    namespace: Mapped[str | None] = mapped_column(String(128))
    model: Mapped[str | None] = mapped_column(String(256))
    entry_id: Mapped[int | None] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), nullable=True)
    semantic_only: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class StoredResponse(Base):
    """A Responses API answer kept because its request said `store: true` (OpenAI's default): what
    `GET /v1/responses/{id}` returns and what a request naming it in `previous_response_id` continues.

    `items` is the conversation up to and including this answer that its upstream does not hold, as
    Responses input items: all of it in front of a chat-only upstream; in front of one that speaks the
    Responses API, only what came after `upstream_response_id`, the answer `upstream` keeps (empty when
    that answer is this one). Keyed by tenant first: one tenant never reads another's ids."""

    __tablename__ = "responses"
    __table_args__ = (Index("ix_responses_expires_at", "expires_at"),)

    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    previous_response_id: Mapped[str | None] = mapped_column(String(128))
    upstream: Mapped[str | None] = mapped_column(String(128))
    upstream_response_id: Mapped[str | None] = mapped_column(String(128))
    # JSON: this request's input items (`GET /v1/responses/{id}/input_items`), the conversation
    # described above, and the response object.
    input: Mapped[bytes] = mapped_column(LargeBinary)
    items: Mapped[bytes] = mapped_column(LargeBinary)
    response: Mapped[bytes] = mapped_column(LargeBinary)


class LimitCount(Base):
    """A scope's admitted requests and charged tokens in one clock minute (`minute`: epoch seconds
    // 60), for replicas that count limits in the database (gateway/limits/sql_counters.py). `scope`
    is `key:<prefix>` or `tenant:<name>`; rows older than a few minutes are deleted."""

    __tablename__ = "limit_counts"

    scope: Mapped[str] = mapped_column(String(160), primary_key=True)
    minute: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    requests: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class LimitLease(Base):
    """A request admitted under a scope's `max_parallel` and not finished yet. A lease left by a
    replica that died mid-request stops counting at `expires_at` and is deleted after it."""

    __tablename__ = "limit_leases"

    scope: Mapped[str] = mapped_column(String(160), primary_key=True)
    lease: Mapped[str] = mapped_column(String(32), primary_key=True)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
