"""Fixtures of the KV-cache tests: a small block layout, private redis-server processes on free
loopback ports (single and a three-master cluster), and the shared Redis on 127.0.0.1:6379 with a
key prefix per test."""

from __future__ import annotations

import random
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.keys import ChainKeyer

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"
LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)


def make_keyer(layout: BlockLayout = LAYOUT, model_id: str = "test-model") -> ChainKeyer:
    return ChainKeyer(layout.block_size, "test-seed", model_id, layout.dtype_name, layout.describe())


def make_kv(num_tokens: int, layout: BlockLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim)
    return torch.randn(shape, generator=g).to(layout.dtype)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too; it must be 55535 or less."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port


def _wait_ping(port: int, up: bool, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            client = redis.Redis(port=port, socket_timeout=0.2, socket_connect_timeout=0.2,
                                 retry=Retry(NoBackoff(), 0))
            ok = bool(client.ping())
            client.close()
        except redis.RedisError:
            ok = False
        if ok == up:
            return
        time.sleep(0.05)
    raise RuntimeError(f"redis on {port} did not become {'up' if up else 'down'}")


@dataclass
class RedisServer:
    """A private redis-server process; stop() and start() it again on the same port."""

    directory: Path
    port: int = field(default_factory=free_port)
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.directory), *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.05)
        if self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited at start: {args}")
        _wait_ping(self.port, up=True)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # a crash, as far as clients can tell
            self.proc.wait(timeout=10)
            self.proc = None
            _wait_ping(self.port, up=False)


def _need_redis_server() -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli not on PATH")


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    _need_redis_server()
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Three cluster masters on free ports; yields a URL of one of them."""
    _need_redis_server()
    servers = []
    for i in range(3):
        d = tmp_path_factory.mktemp(f"cluster{i}")
        cluster_args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        server = RedisServer(d, port=free_cluster_port(), extra=cluster_args)
        server.start()
        servers.append(server)
    try:
        nodes = [f"127.0.0.1:{s.port}" for s in servers]
        create = ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(create, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = redis.Redis(port=servers[0].port).execute_command("CLUSTER INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" in text:
                break
            time.sleep(0.1)
        yield servers[0].url
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def shared_redis_prefix() -> Iterator[str]:
    """A unique key prefix on the shared Redis, deleted afterwards. Redis is a real part of the
    suite (.ci/run starts it): its absence fails the test rather than skipping it."""
    client = redis.Redis.from_url(SHARED_REDIS_URL, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError:
        pytest.fail("no Redis on 127.0.0.1:6379 (start it, or run .ci/run, which does)")
    prefix = f"kvgate-test:{secrets.token_hex(6)}:"
    yield prefix
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)
    client.close()
