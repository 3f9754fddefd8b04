"""The dashboard's KV-tier rows: from the engine in this process, or, when the engine runs as its
own process (`kvgate engine`, docker-compose's `engine` service), from that engine's
`GET /v1/kvgate/kv-tiers`, asked of every upstream marked `send_cache_salt` (a kvgate engine)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.kvcache.manager import KVCacheManager
    from gateway.upstream.router import Router

log = logging.getLogger(__name__)
KV_TIERS_PATH = "/kvgate/kv-tiers"  # under the engine's /v1, so that an upstream's base_url + path reaches it
REMOTE_TIMEOUT_S = 2.0


def tier_rows(kv: KVCacheManager, engine: str | None = None) -> list[dict[str, Any]]:
    block_bytes = kv.layout.block_nbytes if kv.layout is not None else None
    rows = []
    for t in kv.stats().tiers:
        loads = t.hits + t.misses
        rows.append({
            "name": t.name if engine is None else f"{engine}: {t.name}", "up": t.up, "num_blocks": t.num_blocks,
            "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes,
            "occupancy": t.used_bytes / t.capacity_bytes if t.used_bytes is not None and t.capacity_bytes else None,
            "hits": t.hits, "misses": t.misses, "hit_ratio": t.hits / loads if loads else None,
            "evictions": t.evictions, "admission_rejects": t.rejected,
            "bytes_read": t.bytes_out, "bytes_written": t.bytes_in,
            "codec_ratio": (t.num_blocks * block_bytes / t.used_bytes
                            if block_bytes and t.num_blocks and t.used_bytes else None),
        })
    return rows


async def remote_tier_rows(router: Router | None) -> list[dict[str, Any]]:
    """Every engine upstream's tiers, its name in front of each tier's; an engine that does not
    answer in time is left out (and logged), never waited on for long."""
    from gateway.upstream.http import HttpBackend

    if router is None:
        return []
    engines = [b for b in router.backends if isinstance(b, HttpBackend) and b.config.send_cache_salt]

    async def one(backend: HttpBackend) -> list[dict[str, Any]]:
        try:
            answer = await asyncio.wait_for(backend.get_json(KV_TIERS_PATH), REMOTE_TIMEOUT_S)
        except Exception as exc:
            log.warning("KV tiers of upstream %r unavailable: %s", backend.name, exc)
            return []
        rows = answer.get("kv_tiers") if isinstance(answer, dict) else None
        return [{**r, "name": f"{backend.name}: {r.get('name')}"} for r in rows or [] if isinstance(r, dict)]

    return [row for rows in await asyncio.gather(*(one(b) for b in engines)) for row in rows]


async def slot_tier_rows(router: Router | None) -> list[dict[str, Any]]:
    """llama.cpp slot files kept in kvgate's tiers (gateway/slots), one row per tier."""
    keeper = getattr(router, "slots", None)
    if keeper is None or keeper.store is None or not keeper.servers():  # no llama.cpp upstream (yet)
        return []
    return await asyncio.to_thread(keeper.store.rows)  # counting Redis's files is a SCAN
