"""Slots of llama.cpp servers: which slot a request is pinned to, and when a slot's KV is saved to
kvgate's tiers or restored from them.

For each llama.cpp upstream kvgate reads `/props` (model, slot count) and then keeps its own record
of what each slot holds: the prefix blocks of the last prompt it ran (kvgate pins every request it
sends, with `id_slot`, so it knows). A request goes to

- the slot that already holds the longest part of its prompt (a returning conversation), or
- the least recently used idle slot, into which the deepest saved file for its prompt is restored
  first (`POST /slots/{id}?action=restore`) when that file covers more than the slot holds.

After a turn ends well, off the request path, the slot is saved (`?action=save`): the server writes
the file into its `--slot-save-path`, kvgate reads it from `slot_dir`, stores it in its tiers under
the prompt's prefix blocks and removes it there. A request that needs a slot whose save is still
running waits for it (at most `save_wait_s`), so a conversation's KV is always kept before another
conversation overwrites it.

Anything that goes wrong on the way (a server that does not answer, a file of another model or
llama.cpp version, a damaged file) only costs the restore: the request is forwarded as a plain
request and the server prefills what it lacks.

Over 300 lines: choosing a slot, restoring into it and saving it out read and write the same
per-slot record (what it holds, whether a save is running), and are easiest checked side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.slots.settings import SlotSettings
from gateway.slots.store import SlotStore
from gateway.upstream.backend import Backend, JSONObject

log = logging.getLogger(__name__)
PROBE_EVERY_S = 5.0
PROBE_TIMEOUT_S = 3.0
SLOT_CALL_TIMEOUT_S = 30.0


@dataclass(slots=True)
class Slot:
    id: int
    held: tuple[bytes, ...] = ()  # index keys of the prompt it last ran
    busy: int = 0
    used: float = 0.0
    saving: asyncio.Task[None] | None = None


@dataclass(slots=True)
class Server:
    """One llama.cpp upstream as kvgate sees it."""

    backend: Backend
    root: str
    slot_dir: Path | None
    namespace: bytes = b""
    slots: list[Slot] = field(default_factory=list)
    probed_at: float = 0.0


@dataclass(slots=True)
class Pin:
    """A request pinned to a slot; `restored_blocks` came from kvgate's tiers just now."""

    server: Server
    slot: Slot
    keys: tuple[bytes, ...]
    cached_blocks: int = 0  # leading blocks of the prompt the slot holds when the request is sent
    restored_blocks: int = 0
    restored_from: str | None = None
    done: bool = False

    def pinned(self, backend: Backend) -> Backend:
        return PinnedBackend(backend, self.slot.id)

    def header(self) -> str:
        where = f"{self.server.backend.name}#{self.slot.id}"
        return f"{where}; restored={self.restored_from}" if self.restored_from else where


@dataclass(slots=True)
class SlotStats:
    restores: dict[tuple[str, str], int] = field(default_factory=dict)  # (upstream, outcome) -> count
    saves: dict[tuple[str, str], int] = field(default_factory=dict)
    restore_s: float = 0.0  # time spent restoring (on requests' paths) and saving (off them)
    save_s: float = 0.0

    def count(self, table: dict[tuple[str, str], int], upstream: str, outcome: str) -> None:
        table[(upstream, outcome)] = table.get((upstream, outcome), 0) + 1


class PinnedBackend:
    """A backend whose generation requests carry `id_slot`; everything else is the backend's."""

    def __init__(self, backend: Backend, slot: int) -> None:
        self._backend = backend
        self._slot = slot

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    async def post_json(self, path: str, body: JSONObject, **kwargs: Any) -> Any:
        return await self._backend.post_json(path, {**body, "id_slot": self._slot}, **kwargs)

    async def post_stream(self, path: str, body: JSONObject, **kwargs: Any) -> Any:
        return await self._backend.post_stream(path, {**body, "id_slot": self._slot}, **kwargs)


def server_root(base_url: str) -> str:
    """A llama.cpp server's own endpoints (`/props`, `/slots`) sit beside its `/v1`."""
    return base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url


class SlotKeeper:
    def __init__(self, settings: SlotSettings, store: SlotStore | None) -> None:
        self.settings = settings
        self.store = store
        self.stats = SlotStats()
        self._servers: dict[str, Server] = {}
        self._candidates: dict[str, Server] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._probing: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ which upstreams

    def consider(self, backend: Backend, *, kind: str | None, slot_dir: str | None, base_url: str) -> None:
        """An upstream that is (kind "llama.cpp") or may be (kind unset) a llama.cpp server."""
        if kind in ("openai", "vllm") or not self.settings.enabled:
            return
        self._candidates[backend.name] = Server(backend, server_root(base_url), Path(slot_dir) if slot_dir else None)

    def servers(self) -> list[Server]:
        return list(self._servers.values())

    async def probe(self) -> None:
        """Read /props of every candidate not yet known (at start; later, off the request path, at
        most every 5 s while one did not answer)."""
        now = time.monotonic()
        pending = [s for s in self._candidates.values() if now - s.probed_at >= PROBE_EVERY_S]
        await asyncio.gather(*(self._probe(s) for s in pending))

    def _probe_later(self) -> None:
        if self._probing is None or self._probing.done():
            self._probing = asyncio.get_running_loop().create_task(self.probe(), name="slot-probe")

    async def _probe(self, server: Server) -> None:
        server.probed_at = time.monotonic()
        try:
            props = await self._get(server, "/props", timeout_s=PROBE_TIMEOUT_S)
        except AnswerError as exc:  # it answered, without /props: not a llama.cpp server
            log.info("upstream %r is not a llama.cpp server (%s)", server.backend.name, exc)
            self._candidates.pop(server.backend.name, None)
            return
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            log.info("upstream %r: /props not read (%s); asked again later", server.backend.name, exc)
            return
        total = props.get("total_slots")
        if not isinstance(total, int) or total < 1:
            log.info("upstream %r is not a llama.cpp server (no total_slots in /props)", server.backend.name)
            self._candidates.pop(server.backend.name, None)
            return
        model = str(props.get("model_path") or props.get("model_alias") or "")
        server.namespace = hashlib.blake2b(b"llama.cpp\0" + Path(model).name.encode(), digest_size=16).digest()
        server.slots = [Slot(i) for i in range(total)]
        self._candidates.pop(server.backend.name, None)
        self._servers[server.backend.name] = server
        files = (f"slot files via {server.slot_dir}" if server.slot_dir is not None
                 else "no slot_dir: slots pinned, no files kept")
        log.info("upstream %r is llama.cpp: %d slots, model %s, %s", server.backend.name, total,
                 Path(model).name or "?", files)

    def forget(self, name: str) -> None:
        """A server that failed: what its slots held is unknown now (it may have restarted)."""
        server = self._servers.get(name)
        if server is not None:
            for slot in server.slots:
                slot.held = ()

    # ------------------------------------------------------------------ keys

    @staticmethod
    def keys(server: Server, blocks: Sequence[bytes], salt: str) -> tuple[bytes, ...]:
        """The prompt's prefix blocks in this server's namespace: model and tenant."""
        head = server.namespace + salt.encode()
        return tuple(hashlib.blake2b(head + b, digest_size=16).digest() for b in blocks)

    def warm_blocks(self, name: str, blocks: Sequence[bytes], salt: str) -> int:
        """Leading blocks of the prompt that one of this server's slots holds now."""
        server = self._servers.get(name)
        if server is None or not blocks:
            return 0
        keys = self.keys(server, blocks, salt)
        return max((_common(slot.held, keys) for slot in server.slots), default=0)

    # ------------------------------------------------------------------ the request path

    async def pin(self, backend: Backend, blocks: Sequence[bytes], salt: str) -> Pin | None:
        """Choose the slot for this request on `backend` and restore into it what kvgate kept;
        None when `backend` is not a llama.cpp server or the prompt is shorter than a block."""
        if self._candidates:
            self._probe_later()
        server = self._servers.get(backend.name)
        if server is None or not blocks or not server.slots:
            return None
        keys = self.keys(server, blocks, salt)
        slot = self._choose(server, keys)
        slot.busy += 1
        slot.used = time.monotonic()
        pin = Pin(server, slot, keys)
        try:
            await self._settled(slot)
            await self._restore(pin)
        except BaseException:
            slot.busy -= 1
            raise
        pin.cached_blocks = _common(slot.held, keys)
        return pin

    def _choose(self, server: Server, keys: tuple[bytes, ...]) -> Slot:
        idle = [s for s in server.slots if not s.busy] or server.slots
        best = max(idle, key=lambda s: (_common(s.held, keys), -s.used))
        if _common(best.held, keys):
            return best
        return min(idle, key=lambda s: (bool(s.held), s.used))

    async def _settled(self, slot: Slot) -> None:
        """Wait for the slot's last save, so that its KV is kept before this request overwrites it."""
        saving = slot.saving
        if saving is not None and not saving.done():
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(saving), self.settings.save_wait_s)

    async def _restore(self, pin: Pin) -> None:
        server, slot, store = pin.server, pin.slot, self.store
        if store is None or server.slot_dir is None:
            return
        held = _common(slot.held, pin.keys)
        found = await asyncio.to_thread(store.find, pin.keys)
        if found is None or found[1] < held + self.settings.min_gain_blocks:
            return
        key, depth = found
        started = time.perf_counter()
        name = server.backend.name
        got = await asyncio.to_thread(store.get, key)
        if got is None:
            self.stats.count(self.stats.restores, name, "missing")
            return
        data, tier = got
        async with _passing_file(server.slot_dir) as (filename, path):
            try:
                await asyncio.to_thread(path.write_bytes, data)
                answer = await self._post(server, f"/slots/{slot.id}?action=restore", {"filename": filename})
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                slot.held = ()  # a failed restore may have left the slot half-loaded
                self.stats.count(self.stats.restores, name, "failed")
                log.warning("upstream %r: slot %d restore failed (%s); forwarded as a plain request",
                            name, slot.id, exc)
                return
        restored = answer.get("n_restored")
        if not isinstance(restored, int) or restored <= 0:
            slot.held = ()
            self.stats.count(self.stats.restores, name, "failed")
            log.warning("upstream %r: slot %d restored nothing from %s", name, slot.id, key[:12])
            return
        slot.held = pin.keys[:depth]
        pin.restored_blocks, pin.restored_from = depth, tier
        self.stats.count(self.stats.restores, name, "restored")
        self.stats.restore_s += time.perf_counter() - started

    def finish(self, pin: Pin, ok: bool) -> None:
        """The request is over. Its slot now holds its prompt (and answer): save it, off the path."""
        if pin.done:
            return
        pin.done = True
        slot = pin.slot
        slot.busy -= 1
        slot.used = time.monotonic()
        if not ok:
            slot.held = ()
            return
        slot.held = pin.keys
        if self.store is not None and pin.server.slot_dir is not None:
            task = asyncio.get_running_loop().create_task(self._save(pin.server, slot, pin.keys),
                                                          name="slot-save")
            slot.saving = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _save(self, server: Server, slot: Slot, keys: tuple[bytes, ...]) -> None:
        assert self.store is not None and server.slot_dir is not None
        name = server.backend.name
        started = time.perf_counter()
        async with _passing_file(server.slot_dir) as (filename, path):
            try:
                await self._post(server, f"/slots/{slot.id}?action=save", {"filename": filename})
                data = await asyncio.to_thread(path.read_bytes)
                await asyncio.to_thread(self.store.put, keys[-1].hex(), data, keys)
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                self.stats.count(self.stats.saves, name, "failed")
                log.warning("upstream %r: slot %d not saved (%s)", name, slot.id, exc)
                return
        self.stats.count(self.stats.saves, name, "saved")
        self.stats.save_s += time.perf_counter() - started

    async def drain(self) -> None:
        """Wait for the saves in flight (tests, benchmarks, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ------------------------------------------------------------------ HTTP

    async def _get(self, server: Server, path: str, timeout_s: float = SLOT_CALL_TIMEOUT_S) -> JSONObject:
        session: aiohttp.ClientSession = server.backend.session  # type: ignore[attr-defined]
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(server.root + path, timeout=timeout) as response:
            raw = await response.read()
        return _object(response.status, raw, path)

    async def _post(self, server: Server, path: str, body: JSONObject) -> JSONObject:
        session: aiohttp.ClientSession = server.backend.session  # type: ignore[attr-defined]
        timeout = aiohttp.ClientTimeout(total=SLOT_CALL_TIMEOUT_S)
        async with session.post(server.root + path, data=orjson.dumps(body), timeout=timeout) as response:
            raw = await response.read()
        return _object(response.status, raw, path)

    async def aclose(self) -> None:
        if self._probing is not None:
            self._probing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probing
        await self.drain()
        if self.store is not None:
            self.store.close()


@contextlib.asynccontextmanager
async def _passing_file(slot_dir: Path) -> AsyncIterator[tuple[str, Path]]:
    """A fresh file name in a server's slot directory, where slot files pass between the server
    and kvgate; whatever is left there is removed afterwards."""
    filename = f"kvgate-{uuid.uuid4().hex}.bin"
    path = slot_dir / filename
    try:
        yield filename, path
    finally:
        with contextlib.suppress(OSError):
            await asyncio.to_thread(path.unlink, True)


class AnswerError(ValueError):
    """The server answered with an error status."""


def _object(status: int, raw: bytes, path: str) -> JSONObject:
    if status >= 400:
        raise AnswerError(f"{path} answered {status}: {raw[:200].decode('utf-8', 'replace')}")
    parsed = orjson.loads(raw)
    if not isinstance(parsed, dict):
        raise ValueError(f"{path} answered JSON that is not an object")
    return parsed


def _common(held: Sequence[bytes], keys: Sequence[bytes]) -> int:
    n = 0
    for a, b in zip(held, keys, strict=False):
        if a != b:
            break
        n += 1
    return n
