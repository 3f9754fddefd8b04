"""Gateway API keys: created once, stored hashed, resolved to a tenant with a short-lived cache."""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.errors import ServiceUnavailable
from gateway.persistence.models import ApiKey, Tenant

KEY_PREFIX = "kvg-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(slots=True, frozen=True)
class Principal:
    tenant: str
    is_admin: bool = False


async def create_key(sessions: async_sessionmaker, tenant_name: str) -> str:
    """Create (or reuse) the tenant and return a new key; only its hash is stored."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    async with sessions() as session, session.begin():
        tenant = await session.scalar(select(Tenant).where(Tenant.name == tenant_name))
        if tenant is None:
            tenant = Tenant(name=tenant_name)
            session.add(tenant)
            await session.flush()
        session.add(ApiKey(tenant_id=tenant.id, key_hash=hash_key(key), key_prefix=key[:12]))
    return key


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
                row = await session.execute(
                    select(Tenant.name)
                    .join(ApiKey, ApiKey.tenant_id == Tenant.id)
                    .where(ApiKey.key_hash == digest, ApiKey.revoked.is_(False))
                )
                name = row.scalar_one_or_none()
        except (SQLAlchemyError, OSError) as exc:
            # The database is down: keys seen before keep working (even past their TTL), so
            # that an outage does not take the gateway down with it; unknown keys wait for it.
            if cached is not None:
                return cached[0]
            raise ServiceUnavailable("the key database is unavailable; retry shortly") from exc
        if name is None:
            self._cache.pop(digest, None)
            return None
        principal = Principal(tenant=name)
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[digest] = (principal, now + self._ttl_s)
        return principal


async def create_first_key(sessions: async_sessionmaker, tenant_name: str = "default") -> str | None:
    """On a database with no keys at all, create one so that a fresh install is usable at once;
    None when keys exist already."""
    async with sessions() as session:
        if await session.scalar(select(ApiKey.id).limit(1)) is not None:
            return None
    return await create_key(sessions, tenant_name)
