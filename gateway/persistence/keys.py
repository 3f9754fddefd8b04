"""Gateway API keys: created once, stored hashed, resolved to a tenant with a short-lived cache."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import ColumnElement, or_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.errors import ServiceUnavailable
from gateway.limits.policy import Limits
from gateway.persistence.models import ApiKey, Tenant, utcnow

KEY_PREFIX = "kvg-"
ADMIN_TENANT = "admin"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(slots=True, frozen=True)
class Principal:
    tenant: str
    is_admin: bool = False
    # The key's 12-character prefix (the request log's `key_prefix`); None for the environment's
    # admin key and --no-auth.
    key_prefix: str | None = None
    limits: Limits | None = None  # the key's
    tenant_limits: Limits | None = None


@dataclass(slots=True, frozen=True)
class KeyInfo:
    """What `kvgate keys list` shows of a key: never the key, only its first 12 characters."""

    prefix: str
    tenant: str
    is_admin: bool
    created_at: datetime
    expires_at: datetime | None
    revoked: bool
    limits: Limits = field(default_factory=Limits)
    tenant_limits: Limits = field(default_factory=Limits)

    def state(self, now: datetime) -> str:
        if self.revoked:
            return "revoked"
        if self.expires_at is not None and _aware(self.expires_at) <= now:
            return "expired"
        return "active"


def _aware(moment: datetime) -> datetime:
    # SQLite returns naive datetimes for timezone-aware columns; they were written in UTC.
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


# A limit as `kvgate keys create|update` and `/admin/keys` name it, and its column on keys and tenants.
LIMIT_COLUMNS = {"rpm": "rpm_limit", "tpm": "tpm_limit", "max_parallel": "max_parallel", "budget_usd": "budget_usd",
                 "budget_period_s": "budget_period_s"}


def apply_limits(row: ApiKey | Tenant, changes: dict[str, int | float | None]) -> None:
    """Set the limits named in `changes` (None removes one). A budget's periods start when it is
    first set, and again when its period changes; a new amount keeps the period it is in."""
    for name, value in changes.items():
        setattr(row, LIMIT_COLUMNS[name], value)
    if "budget_usd" in changes or "budget_period_s" in changes:
        if row.budget_usd is None:
            row.budget_period_s, row.budget_started_at = None, None
        elif row.budget_started_at is None or "budget_period_s" in changes:
            row.budget_started_at = utcnow()


async def _tenant(session: AsyncSession, tenant_name: str) -> Tenant:
    tenant = await session.scalar(select(Tenant).where(Tenant.name == tenant_name))
    if tenant is None:
        tenant = Tenant(name=tenant_name)
        session.add(tenant)
        await session.flush()
    return tenant


async def create_key(sessions: async_sessionmaker, tenant_name: str, *, expires_in: timedelta | None = None,
                     is_admin: bool = False, limits: dict[str, int | float | None] | None = None) -> str:
    """Create (or reuse) the tenant and return a new key; only its hash is stored."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    expires_at = utcnow() + expires_in if expires_in is not None else None
    async with sessions() as session, session.begin():
        tenant = await _tenant(session, tenant_name)
        row = ApiKey(tenant_id=tenant.id, key_hash=hash_key(key), key_prefix=key[:12], expires_at=expires_at,
                     is_admin=is_admin)
        apply_limits(row, limits or {})
        session.add(row)
    return key


async def update_limits(sessions: async_sessionmaker, changes: dict[str, int | float | None], *,
                        key_or_prefix: str | None = None, tenant_name: str | None = None) -> int:
    """Change the limits of one active key (given in full or by its prefix) or of a tenant (created
    when new, so limits can be set before its first key). Returns how many matched; only a single
    match is changed. Gateways apply the change within KVGATE_KEY_CACHE_TTL_S."""
    async with sessions() as session, session.begin():
        if tenant_name is not None:
            apply_limits(await _tenant(session, tenant_name), changes)
            return 1
        assert key_or_prefix is not None
        rows = list(await session.scalars(select(ApiKey).where(_key_matches(key_or_prefix), ApiKey.revoked.is_(False))))
        if len(rows) == 1:
            apply_limits(rows[0], changes)
        return len(rows)


async def tenant_limits(sessions: async_sessionmaker, tenant_name: str) -> Limits:
    async with sessions() as session:
        tenant = await session.scalar(select(Tenant).where(Tenant.name == tenant_name))
    return Limits.of_row(tenant) if tenant is not None else Limits()


def _key_matches(key_or_prefix: str) -> ColumnElement[bool]:
    if len(key_or_prefix) > 12:
        return ApiKey.key_hash == hash_key(key_or_prefix)
    return ApiKey.key_prefix == key_or_prefix


async def list_keys(sessions: async_sessionmaker, tenant_name: str | None = None,
                    prefix: str | None = None, prefixes: Collection[str] | None = None) -> list[KeyInfo]:
    """Every key, or those of a tenant, of one prefix, or of any of `prefixes`."""
    query = select(ApiKey, Tenant).join(Tenant, ApiKey.tenant_id == Tenant.id).order_by(ApiKey.id)
    if tenant_name is not None:
        query = query.where(Tenant.name == tenant_name)
    if prefix is not None:
        query = query.where(ApiKey.key_prefix == prefix)
    if prefixes is not None:
        query = query.where(ApiKey.key_prefix.in_(list(prefixes)))
    async with sessions() as session:
        rows = (await session.execute(query)).all()
    return [KeyInfo(key.key_prefix, tenant.name, bool(key.is_admin), key.created_at, key.expires_at, bool(key.revoked),
                    Limits.of_row(key), Limits.of_row(tenant))
            for key, tenant in rows]


async def revoke_key(sessions: async_sessionmaker, key_or_prefix: str) -> int:
    """Revoke the key given in full or by the 12-character prefix `keys list` shows. Returns how many
    active keys matched; only a single match is revoked (a prefix two keys share is ambiguous)."""
    where = _key_matches(key_or_prefix)
    async with sessions() as session, session.begin():
        ids = list(await session.scalars(select(ApiKey.id).where(where, ApiKey.revoked.is_(False))))
        if len(ids) == 1:
            await session.execute(update(ApiKey).where(ApiKey.id == ids[0]).values(revoked=True))
    return len(ids)


class KeyStore:
    """Resolves keys to principals. Positive answers are cached for `ttl_s` so that the hot path
    does not touch the database; a revoked key stops working within that time."""

    def __init__(self, sessions: async_sessionmaker, admin_key: str | None, ttl_s: float) -> None:
        self._sessions = sessions
        self._admin_hash = hash_key(admin_key) if admin_key else None
        self._ttl_s = ttl_s
        self._cache: dict[str, tuple[Principal, float]] = {}

    async def resolve(self, key: str) -> Principal | None:
        digest = hash_key(key)
        if self._admin_hash is not None and secrets.compare_digest(digest, self._admin_hash):
            return Principal(tenant="admin", is_admin=True)
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            async with self._sessions() as session:
                found = (await session.execute(
                    select(ApiKey, Tenant)
                    .join(Tenant, ApiKey.tenant_id == Tenant.id)
                    .where(ApiKey.key_hash == digest, ApiKey.revoked.is_(False),
                           or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > utcnow()))
                )).one_or_none()
        except (SQLAlchemyError, OSError) as exc:
            # The database is down: keys seen before keep working (even past their TTL), so
            # that an outage does not take the gateway down with it; unknown keys wait for it.
            if cached is not None:
                return cached[0]
            raise ServiceUnavailable("the key database is unavailable; retry shortly") from exc
        if found is None:
            self._cache.pop(digest, None)
            return None
        key_row, tenant_row = found
        expires_at = key_row.expires_at
        principal = Principal(tenant=tenant_row.name, is_admin=bool(key_row.is_admin), key_prefix=key_row.key_prefix,
                              limits=Limits.of_row(key_row), tenant_limits=Limits.of_row(tenant_row))
        if len(self._cache) > 10_000:
            self._cache.clear()
        # An expiring key is cached no longer than it lives.
        lifetime_s = self._ttl_s
        if expires_at is not None:
            lifetime_s = min(lifetime_s, (_aware(expires_at) - utcnow()).total_seconds())
        self._cache[digest] = (principal, now + lifetime_s)
        return principal


@dataclass(slots=True, frozen=True)
class FirstKeys:
    tenant_key: str
    admin_key: str


async def create_first_keys(sessions: async_sessionmaker, tenant_name: str = "default") -> FirstKeys | None:
    """On a database with no keys at all, create a tenant key and an admin key (for the dashboard)
    so that a fresh install is usable at once; None when keys exist already."""
    async with sessions() as session:
        if await session.scalar(select(ApiKey.id).limit(1)) is not None:
            return None
    tenant_key = await create_key(sessions, tenant_name)
    return FirstKeys(tenant_key, await create_key(sessions, ADMIN_TENANT, is_admin=True))
