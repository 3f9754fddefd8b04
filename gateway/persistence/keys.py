"""Gateway API keys: created once, stored hashed, resolved to a tenant with a short-lived cache."""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.errors import ServiceUnavailable
from gateway.persistence.models import ApiKey, Tenant, utcnow

KEY_PREFIX = "kvg-"
ADMIN_TENANT = "admin"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(slots=True, frozen=True)
class Principal:
    tenant: str
    is_admin: bool = False


@dataclass(slots=True, frozen=True)
class KeyInfo:
    """What `kvgate keys list` shows of a key: never the key, only its first 12 characters."""

    prefix: str
    tenant: str
    is_admin: bool
    created_at: datetime
    expires_at: datetime | None
    revoked: bool

    def state(self, now: datetime) -> str:
        if self.revoked:
            return "revoked"
        if self.expires_at is not None and _aware(self.expires_at) <= now:
            return "expired"
        return "active"


def _aware(moment: datetime) -> datetime:
    # SQLite returns naive datetimes for timezone-aware columns; they were written in UTC.
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


async def create_key(sessions: async_sessionmaker, tenant_name: str, *, expires_in: timedelta | None = None,
                     is_admin: bool = False) -> str:
    """Create (or reuse) the tenant and return a new key; only its hash is stored."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    expires_at = utcnow() + expires_in if expires_in is not None else None
    async with sessions() as session, session.begin():
        tenant = await session.scalar(select(Tenant).where(Tenant.name == tenant_name))
        if tenant is None:
            tenant = Tenant(name=tenant_name)
            session.add(tenant)
            await session.flush()
        session.add(ApiKey(tenant_id=tenant.id, key_hash=hash_key(key), key_prefix=key[:12],
                           expires_at=expires_at, is_admin=is_admin))
    return key


async def list_keys(sessions: async_sessionmaker, tenant_name: str | None = None) -> list[KeyInfo]:
    query = (select(ApiKey.key_prefix, Tenant.name, ApiKey.is_admin, ApiKey.created_at, ApiKey.expires_at,
                    ApiKey.revoked)
             .join(Tenant, ApiKey.tenant_id == Tenant.id).order_by(ApiKey.id))
    if tenant_name is not None:
        query = query.where(Tenant.name == tenant_name)
    async with sessions() as session:
        rows = (await session.execute(query)).all()
    return [KeyInfo(prefix, tenant, bool(admin), created, expires, bool(revoked))
            for prefix, tenant, admin, created, expires, revoked in rows]


async def revoke_key(sessions: async_sessionmaker, key_or_prefix: str) -> int:
    """Revoke the key given in full or by the 12-character prefix `keys list` shows. Returns how many
    active keys matched; only a single match is revoked (a prefix two keys share is ambiguous)."""
    if len(key_or_prefix) > 12:
        where = ApiKey.key_hash == hash_key(key_or_prefix)
    else:
        where = ApiKey.key_prefix == key_or_prefix
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
                row = (await session.execute(
                    select(Tenant.name, ApiKey.is_admin, ApiKey.expires_at)
                    .join(ApiKey, ApiKey.tenant_id == Tenant.id)
                    .where(ApiKey.key_hash == digest, ApiKey.revoked.is_(False),
                           or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > utcnow()))
                )).one_or_none()
        except (SQLAlchemyError, OSError) as exc:
            # The database is down: keys seen before keep working (even past their TTL), so
            # that an outage does not take the gateway down with it; unknown keys wait for it.
            if cached is not None:
                return cached[0]
            raise ServiceUnavailable("the key database is unavailable; retry shortly") from exc
        if row is None:
            self._cache.pop(digest, None)
            return None
        name, is_admin, expires_at = row
        principal = Principal(tenant=name, is_admin=bool(is_admin))
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
