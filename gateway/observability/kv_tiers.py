"""The dashboard's KV-tier rows: from the engine in this process, or, when the engine runs as its
own process (`kvgate engine`, docker-compose's `engine` service), from that engine's
`GET /v1/kvgate/kv-tiers`, asked of every upstream marked `send_cache_salt` (a kvgate engine); and
from each vLLM upstream running kvgate's KV connector, read off vLLM's own `/metrics`
(`vllm:kvgate_tier_blocks` and `_used_bytes`, gateway/vllm/stats.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

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


def connector_rows(name: str, metrics_text: str) -> list[dict[str, Any]]:
    """One row per bounded tier of kvgate's connector, from a vLLM server's `/metrics` text."""
    tiers: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name not in ("vllm:kvgate_tier_blocks", "vllm:kvgate_tier_used_bytes"):
            continue
        field = "num_blocks" if family.name.endswith("blocks") else "used_bytes"
        for sample in family.samples:
            tier = sample.labels.get("tier")
            if tier:
                row = tiers.setdefault(tier, {"name": f"{name}: {tier}", "up": True})
                row[field] = int(row.get(field, 0) + sample.value)
    return list(tiers.values())


async def vllm_tier_rows(router: Router | None) -> list[dict[str, Any]]:
    """The connector's tiers on every vLLM upstream (`kind: "vllm"`, or followed for its events);
    a server that does not answer in time, or runs without the connector, adds no row."""
    from gateway.slots.keeper import server_root
    from gateway.upstream.http import HttpBackend

    if router is None:
        return []
    followed = {s.backend.name for s in router.vllm.servers()} if router.vllm is not None else set()
    servers = [b for b in router.backends if isinstance(b, HttpBackend)
               and (b.config.kind == "vllm" or b.name in followed)]

    async def one(client: httpx.AsyncClient, backend: HttpBackend) -> list[dict[str, Any]]:
        try:
            response = await client.get(server_root(backend.config.base_url) + "/metrics")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("KV tiers of vLLM upstream %r unavailable: %s", backend.name, exc)
            return []
        return connector_rows(backend.name, response.text)

    if not servers:
        return []
    async with httpx.AsyncClient(timeout=REMOTE_TIMEOUT_S) as client:
        rows = await asyncio.gather(*(one(client, b) for b in servers))
    return [row for group in rows for row in group]
