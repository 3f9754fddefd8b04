"""Stored Responses API answers (`store: true`), per tenant, until they expire.

Written before the client gets the answer's last byte, so that a follow-up sent at once, to any
replica, finds it; read by id and tenant only, so an id of one tenant does not exist for another.
Expired rows are never read, and deleted in one statement at most every `sweep_interval_s` by the
next store.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import orjson
from sqlalchemy import delete, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.errors import ServiceUnavailable
from gateway.persistence.database import describe_db_error
from gateway.persistence.models import StoredResponse, utcnow
from gateway.persistence.settings import ResponsesSettings

log = logging.getLogger(__name__)
Item = dict[str, Any]


@dataclass(slots=True)
class ResponseRecord:
    """One stored answer; the fields are `StoredResponse`'s (gateway/persistence/models.py)."""

    tenant: str
    id: str
    model: str
    response: dict[str, Any]
    input: list[Item]
    items: list[Item] = field(default_factory=list)
    previous_response_id: str | None = None
    upstream: str | None = None
    upstream_response_id: str | None = None


class ResponseStore:
    def __init__(self, sessions: async_sessionmaker, settings: ResponsesSettings) -> None:
        self._sessions = sessions
        self._settings = settings
        self._next_sweep = time.monotonic() + settings.sweep_interval_s

    async def get(self, tenant: str, response_id: str) -> ResponseRecord | None:
        """The tenant's unexpired answer `response_id`, or None."""
        query = select(StoredResponse).where(StoredResponse.tenant == tenant, StoredResponse.id == response_id,
                                             StoredResponse.expires_at > utcnow())
        try:
            async with self._sessions() as session:
                row = await session.scalar(query)
        except (SQLAlchemyError, OSError) as exc:
            raise _unavailable(exc) from exc
        if row is None:
            return None
        return ResponseRecord(tenant=row.tenant, id=row.id, model=row.model, response=orjson.loads(row.response),
                              input=orjson.loads(row.input), items=orjson.loads(row.items),
                              previous_response_id=row.previous_response_id, upstream=row.upstream,
                              upstream_response_id=row.upstream_response_id)

    async def save(self, record: ResponseRecord) -> None:
        """Store `record` (replacing one of the same tenant and id); ServiceUnavailable when the
        database is down, since a follow-up would not find it."""
        now = utcnow()
        row = StoredResponse(tenant=record.tenant, id=record.id, model=record.model, created_at=now,
                             expires_at=now + timedelta(seconds=self._settings.ttl_s),
                             previous_response_id=record.previous_response_id, upstream=record.upstream,
                             upstream_response_id=record.upstream_response_id, input=orjson.dumps(record.input),
                             items=orjson.dumps(record.items), response=orjson.dumps(record.response))
        try:
            async with self._sessions() as session, session.begin():
                await session.merge(row)
        except (SQLAlchemyError, OSError) as exc:
            raise _unavailable(exc) from exc
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + self._settings.sweep_interval_s
            await self.sweep()

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Delete the tenant's answer `response_id`; whether there was one (expired ones count as none)."""
        query = delete(StoredResponse).where(StoredResponse.tenant == tenant, StoredResponse.id == response_id,
                                             StoredResponse.expires_at > utcnow())
        try:
            async with self._sessions() as session, session.begin():
                result = await session.execute(query)
        except (SQLAlchemyError, OSError) as exc:
            raise _unavailable(exc) from exc
        return bool(getattr(result, "rowcount", 0))

    async def sweep(self) -> int:
        """Delete every expired answer; how many. A failure is logged: the next sweep retries."""
        try:
            async with self._sessions() as session, session.begin():
                result = await session.execute(delete(StoredResponse).where(StoredResponse.expires_at <= utcnow()))
        except (SQLAlchemyError, OSError) as exc:
            log.warning("stored responses: expired ones not deleted: %s", describe_db_error(exc))
            return 0
        return int(getattr(result, "rowcount", 0) or 0)


def _unavailable(exc: BaseException) -> ServiceUnavailable:
    log.warning("stored responses: database error: %s", describe_db_error(exc))
    return ServiceUnavailable("the response store is unavailable; retry shortly")
