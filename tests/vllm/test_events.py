"""vLLM's KV events: the wire format decoded, and a subscriber following a publisher over real ZMQ
sockets that speak vLLM's protocol (PUB frames, ROUTER replay), through gaps, reconnects and restarts.

The structs below copy vLLM's `vllm/distributed/kv_events.py` (0.32), so the payloads are the bytes
vLLM sends (checked once by decoding them with vLLM's own classes); the gateway does not import vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.vllm.blocks import ServerBlocks, prompt_chain
from gateway.vllm.events import Cleared, DecodeError, EventSubscriber, Removed, Stored, decode_batch
from tests.servers import free_port


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class OldBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):  # type: ignore[call-arg]
    """vLLM before 0.11: events as arrays, tag first."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


SIZE = 4
PROMPT = list(range(200, 216))  # 4 blocks


def stored(names: list[int], parent: int | None = None, first: int = 0, medium: str | None = "GPU",
           **extra: Any) -> BlockStored:
    tokens = PROMPT[first * SIZE:(first + len(names)) * SIZE]
    return BlockStored(names, parent, tokens, SIZE, None, medium, None, group_idx=0,
                       kv_cache_spec_kind="full_attention", **extra)


def payload(*events: KVCacheEvent) -> bytes:
    return msgspec.msgpack.encode(EventBatch(1.0, list(events), 0))


# ---------------------------------------------------------------------- decoding


def test_a_batch_decodes_to_its_events_in_order() -> None:
    events = decode_batch(payload(stored([1, 2]), BlockRemoved([2], "GPU"), AllBlocksCleared()))
    assert events == [Stored([1, 2], None, PROMPT[:8], SIZE, None), Removed([2]), Cleared()]


def test_bytes_hashes_and_salts_come_through() -> None:
    event = BlockStored([b"\x01" * 32], b"\x00" * 32, PROMPT[:4], SIZE, None, "GPU", None, extra_keys=[("salt",)])
    (decoded,) = decode_batch(payload(event))
    assert isinstance(decoded, Stored)
    assert decoded.block_hashes == [b"\x01" * 32] and decoded.parent == b"\x00" * 32
    assert decoded.extra_keys == [["salt"]]


def test_old_array_events_decode_too() -> None:
    raw = msgspec.msgpack.encode([1.0, [OldBlockStored([7, 8], None, PROMPT[:8], SIZE, None)]])
    assert decode_batch(raw) == [Stored([7, 8], None, PROMPT[:8], SIZE, None)]


def test_blocks_outside_the_engine_cache_are_ignored() -> None:
    """An offloading connector's CPU copies are not prefix-cache hits."""
    assert decode_batch(payload(stored([1], medium="CPU"), BlockRemoved([1], "CPU"))) == []
    assert len(decode_batch(payload(stored([1], medium=None)))) == 1


@pytest.mark.parametrize("raw", [b"\xc1", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode([1.0, [5]])])
def test_what_is_not_a_batch_is_refused(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(raw)


# ---------------------------------------------------------------------- following a publisher


class Publisher:
    """vLLM's `ZmqEventPublisher` protocol on real sockets: PUB (topic, seq, payload) and a ROUTER
    that answers a start seq with the buffered batches from there, then (b"", -1, b"")."""

    def __init__(self, ctx: zmq.asyncio.Context, port: int, replay_port: int) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=100)
        self.seq = 0
        self._replays = asyncio.get_running_loop().create_task(self._serve_replays())

    async def publish(self, *events: KVCacheEvent, live: bool = True) -> None:
        """`live` False: buffered for replay, never sent (a batch the SUB socket dropped)."""
        data = payload(*events)
        if live:
            await self.pub.send_multipart([b"kv-events", self.seq.to_bytes(8, "big"), data])
        self.buffer.append((self.seq, data))
        self.seq += 1

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq, data in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", b"kv-events", seq.to_bytes(8, "big"), data])
            await self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        self._replays.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._replays
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def wire() -> AsyncIterator[tuple[Callable[[], Any], EventSubscriber]]:
    """(start_publisher, subscriber): a publisher is started (or restarted) on fixed ports."""
    ctx = zmq.asyncio.Context()
    port, replay_port = free_port(), free_port()
    publishers: list[Publisher] = []

    def start() -> Publisher:
        publishers.append(Publisher(ctx, port, replay_port))
        return publishers[-1]

    subscriber = EventSubscriber("vllm0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}",
                                 ServerBlocks())
    yield start, subscriber
    await subscriber.aclose()
    for publisher in publishers:
        await publisher.close()
    ctx.destroy(linger=0)


def held(subscriber: EventSubscriber) -> int:
    return subscriber.blocks.matched_blocks(prompt_chain(PROMPT, SIZE))


async def test_batches_published_before_the_subscriber_are_replayed(wire: Any) -> None:
    start, subscriber = wire
    publisher = start()
    await publisher.publish(stored([1, 2]))
    await publisher.publish(stored([3], parent=2, first=2))
    subscriber.start()
    await until(lambda: held(subscriber) == 3)
    await until(lambda: subscriber.connected)
    await publisher.publish(stored([4], parent=3, first=3))
    await until(lambda: held(subscriber) == 4)
    await publisher.publish(BlockRemoved([2], "GPU"))
    await until(lambda: held(subscriber) == 1)


async def test_a_gap_in_the_sequence_is_filled_from_the_replay(wire: Any) -> None:
    start, subscriber = wire
    publisher = start()
    subscriber.start()
    await until(lambda: subscriber.connected and subscriber._next == 0)
    await asyncio.sleep(0.2)  # the subscription reaches the publisher
    await publisher.publish(stored([1, 2]))
    await until(lambda: held(subscriber) == 2)
    await publisher.publish(stored([3], parent=2, first=2), live=False)  # dropped on the way
    await publisher.publish(stored([4], parent=3, first=3))
    await until(lambda: held(subscriber) == 4)
    assert subscriber.num_gaps == 1


async def test_a_restarted_server_is_forgotten_then_rebuilt(wire: Any) -> None:
    """The old process's blocks go with its connection; the new one's history (its seq from 0) is
    read in full, not taken for duplicates of the old one's."""
    start, subscriber = wire
    publisher = start()
    await publisher.publish(stored([1, 2]))
    await publisher.publish(stored([3, 4], parent=2, first=2))
    subscriber.start()
    await until(lambda: held(subscriber) == 4)
    await publisher.close()
    await until(lambda: not subscriber.connected)
    assert len(subscriber.blocks) == 0
    restarted = start()
    await restarted.publish(stored([51]))
    await until(lambda: held(subscriber) == 1)
    await until(lambda: subscriber.connected)
    await asyncio.sleep(0.2)
    await restarted.publish(stored([52], parent=51, first=1))
    await until(lambda: held(subscriber) == 2)


async def test_forget_rebuilds_from_the_replay_of_a_live_server(wire: Any) -> None:
    start, subscriber = wire
    publisher = start()
    await publisher.publish(stored([1, 2, 3]))
    subscriber.start()
    await until(lambda: held(subscriber) == 3)
    subscriber.forget()
    assert held(subscriber) == 0
    await until(lambda: held(subscriber) == 3)


async def test_all_blocks_cleared_empties_the_server(wire: Any) -> None:
    start, subscriber = wire
    publisher = start()
    await publisher.publish(stored([1, 2, 3]))
    await publisher.publish(AllBlocksCleared())
    await publisher.publish(stored([7]))
    subscriber.start()
    await until(lambda: subscriber.num_batches == 3)
    assert held(subscriber) == 1 and len(subscriber.blocks) == 1
