"""vLLM's KV events: decoded from the wire, and followed for one server into its `ServerBlocks`.

A vLLM server started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:PORT", "replay_endpoint": "tcp://*:PORT2", ...}'` publishes each engine step's
block changes on a ZMQ PUB socket as three frames: topic, sequence number (8 bytes, big-endian),
payload. The payload is vLLM's `KVEventBatch` in msgpack: `[ts, [event, ...], dp_rank]`, each event a
map tagged by `type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`; vLLM before 0.11 sent them
as arrays, tag first: both are read). They are decoded generically here; the gateway does not
import vLLM.

The replay endpoint (a ROUTER socket) answers a start sequence number with every batch it still
buffers from there (10,000 by default), then an end marker (sequence -1). The subscriber uses it

- on every connect, from 0: the server's whole history is rebuilt, from a fresh server or one the
  gateway has not seen (it started earlier, or it restarted: a disconnect first drops what the
  server held, since a restarted vLLM holds nothing);
- on a gap in the sequence (the SUB socket dropped batches past its high-water mark).

A gap the buffer no longer covers drops the server's blocks: a missed `BlockRemoved` would
otherwise leave blocks in the index that the server no longer holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.vllm.blocks import ServerBlocks

log = logging.getLogger(__name__)
END_SEQ = -1
REPLAY_TIMEOUT_S = 5.0
# The loop wakes at least this often to see a `forget` (the router's health check) and resync.
WAKE_MS = 500
# Events about blocks outside the engine's own KV cache (an offloading connector's CPU or disk
# copies) do not make a prefix-cache hit; older vLLM sends no medium.
MEDIA = (None, "GPU")


@dataclass(slots=True, frozen=True)
class Stored:
    block_hashes: Sequence[Hashable]
    parent: Hashable | None
    token_ids: Sequence[int]
    block_size: int
    extra_keys: Sequence[Sequence[Any] | None] | None = None


@dataclass(slots=True, frozen=True)
class Removed:
    block_hashes: Sequence[Hashable]


@dataclass(slots=True, frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


class DecodeError(ValueError):
    """A payload that is not a KV event batch."""


def _hashable(value: Any) -> Hashable:
    return tuple(value) if isinstance(value, list) else value


def decode_event(raw: Any) -> Event | None:
    """One event (a tagged map, or an array with its tag first); None for one kvgate ignores."""
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                 "medium", "lora_name", "extra_keys"),
                 "BlockRemoved": ("block_hashes", "medium")}.get(tag, ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise DecodeError(f"not a KV event: {raw!r:.80}")
    if tag == "AllBlocksCleared":
        return Cleared()
    if fields.get("medium") not in MEDIA:
        return None
    hashes = [_hashable(h) for h in fields.get("block_hashes") or ()]
    if tag == "BlockRemoved":
        return Removed(hashes)
    if tag == "BlockStored":
        parent = fields.get("parent_block_hash")
        return Stored(hashes, None if parent is None else _hashable(parent), fields.get("token_ids") or [],
                      int(fields["block_size"]), fields.get("extra_keys"))
    return None


def decode_batch(payload: bytes) -> list[Event]:
    """A `KVEventBatch` payload's events, in order."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"not msgpack: {exc}") from exc
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise DecodeError(f"not a KV event batch: {batch!r:.80}")
    return [event for raw in batch[1] if (event := decode_event(raw)) is not None]


def apply(blocks: ServerBlocks, events: Sequence[Event]) -> None:
    for event in events:
        if isinstance(event, Stored):
            blocks.stored(event.block_hashes, event.parent, event.token_ids, event.block_size, event.extra_keys)
        elif isinstance(event, Removed):
            blocks.removed(event.block_hashes)
        else:
            blocks.clear()


class EventSubscriber:
    """Follows one vLLM server's KV events into `blocks`, from `start` to `aclose`."""

    def __init__(self, name: str, endpoint: str, replay_endpoint: str | None, blocks: ServerBlocks) -> None:
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.blocks = blocks
        self.connected = False
        self.num_batches = 0
        self.num_gaps = 0  # sequence gaps seen (each one replayed, or the server's blocks dropped)
        self._next: int | None = None  # the sequence number expected next; None: any
        self._resync = False
        self._ctx = zmq.asyncio.Context()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"vllm-events-{self.name}")

    def forget(self) -> None:
        """The server failed its health check: it may have restarted. Its blocks are dropped now and
        rebuilt from the replay buffer, which a live server still holds."""
        self.blocks.clear()
        self._resync = True

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._ctx.destroy(linger=0)

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll(WAKE_MS))
                # Connection changes first: a restarted server's first batches must not be read as
                # duplicates of the old process's.
                while monitor in ready and await monitor.poll(0):
                    self._connection(parse_monitor_message(await monitor.recv_multipart())["event"])
                if self._resync:
                    self._resync = False
                    await self._replay(0)
                while await sub.poll(0):
                    _, seq, payload = await sub.recv_multipart()
                    await self._receive(int.from_bytes(seq, "big", signed=True), payload, live=True)
        except Exception:
            log.exception("vllm events of upstream %r: subscriber stopped", self.name)
            raise
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _connection(self, event: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            log.info("vllm events of upstream %r: disconnected; its blocks are forgotten", self.name)
            self.connected = False
            self.blocks.clear()
            self._next = None
        elif event == zmq.EVENT_CONNECTED:
            log.info("vllm events of upstream %r: connected to %s", self.name, self.endpoint)
            self.connected = True
            self.blocks.clear()
            self._resync = True

    async def _receive(self, seq: int, payload: bytes, *, live: bool) -> None:
        if self._next is not None and seq < self._next:
            return  # already applied (replayed while the live socket queued it)
        if live and self._next is not None and seq > self._next:
            self.num_gaps += 1
            await self._replay(self._next)
            if self._next is not None and seq < self._next:
                return
            if self._next is not None and seq > self._next:  # the replay did not answer
                log.warning("vllm events of upstream %r: batches %d to %d are lost; its blocks are forgotten",
                            self.name, self._next, seq - 1)
                self.blocks.clear()
        try:
            events = decode_batch(payload)
        except DecodeError as exc:
            log.warning("vllm events of upstream %r: batch %d unreadable (%s)", self.name, seq, exc)
            events = []
        apply(self.blocks, events)
        self.num_batches += 1
        self._next = seq + 1

    async def _replay(self, start: int) -> None:
        """Apply every buffered batch from `start` (a fresh socket each time: a late answer to a
        replay that timed out must not be read as the next one's)."""
        if self.replay_endpoint is None:
            self._next = None if start == 0 else self._next
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            first = True
            while await dealer.poll(int(REPLAY_TIMEOUT_S * 1000)):
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    if first and start == 0:
                        self._next = 0  # nothing published yet
                    return
                if first and seq != start and start > 0:
                    log.warning("vllm events of upstream %r: batches %d to %d are lost; its blocks are forgotten",
                                self.name, start, seq - 1)
                    self.blocks.clear()
                if first:
                    self._next = seq  # from 0: what the buffer still holds (a long-lived server's tail)
                first = False
                await self._receive(seq, frames[3], live=False)
            log.warning("vllm events of upstream %r: no replay from %s in %.0f s", self.name,
                        self.replay_endpoint, REPLAY_TIMEOUT_S)
        finally:
            dealer.close(linger=0)
