"""Scale-out on one machine: two gateway processes and two engine processes on loopback, sharing
a real PostgreSQL database and a real Redis, as docker-compose runs them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from tests.conftest import fresh_postgres_database, new_key
from tests.deploy.stack import eventually, write_behind_settled
from tests.servers import free_port

REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = "smollm2-135m-instruct"


@contextmanager
def process(args: list[str], port: int, cwd: Path, **env: str) -> Iterator[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    log = (cwd / f"proc-{port}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "gateway", *args, "--port", str(port)], cwd=cwd,
                            env={**clean, **env}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (cwd / f"proc-{port}.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{args[0]} on {port} did not become ready"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    prefix = f"kvgate-scale:{uuid.uuid4().hex}:"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)


def engine_env(prefix: str) -> dict[str, str]:
    return {"KVGATE_KVCACHE__REDIS_URL": REDIS_URL, "KVGATE_KVCACHE__REDIS_KEY_PREFIX": prefix,
            "KVGATE_KVCACHE__SKIP_SLOW_TIERS": "false", "KVGATE_KVCACHE__HOST_CAPACITY_BYTES": str(256 << 20),
            "KVGATE_KVCACHE__DEVICE_CAPACITY_BYTES": "0", "KVGATE_LOG_LEVEL": "warning"}


def test_two_gateways_two_engines(tmp_path: Path, redis_prefix: str) -> None:
    messages = [{"role": "user", "content": "Explain in two sentences why the sky looks blue during the day."}]
    with ExitStack() as stack:
        engines = [stack.enter_context(process(["engine"], free_port(), tmp_path, **engine_env(redis_prefix)))
                   for _ in range(2)]
        database_url = stack.enter_context(fresh_postgres_database())
        key = new_key(database_url, "team-a")
        gateway_env = {"KVGATE_DATABASE_URL": database_url, "KVGATE_LOG_LEVEL": "warning",
                       "KVGATE_RESPONSECACHE__REDIS_URL": REDIS_URL,
                       "KVGATE_RESPONSECACHE__REDIS_CHANNEL": redis_prefix + "feed",
                       "KVGATE_UPSTREAMS": '[' + ", ".join(
                           f'{{"name": "engine{i}", "base_url": "{e}/v1", "send_cache_salt": true}}'
                           for i, e in enumerate(engines)) + ']'}
        gateways = [stack.enter_context(process(["serve"], free_port(), tmp_path, **gateway_env)) for _ in range(2)]
        auth = {"authorization": f"Bearer {key}"}

        # A prefix computed by engine 1 is restored by engine 2 from the shared Redis tier.
        body = {"model": MODEL, "messages": messages, "max_tokens": 12}
        salt = {"x-kvgate-cache-salt": "tenant-x"}
        first = httpx.post(engines[0] + "/v1/chat/completions", json=body, headers=salt, timeout=120).json()
        # Engine 1 stores its blocks behind the answer: engine 2 can restore them once they reached Redis.
        eventually(lambda: write_behind_settled(engines[0]), 60, "engine 1's write-behind store in Redis")
        second = httpx.post(engines[1] + "/v1/chat/completions", json=body, headers=salt, timeout=120).json()
        # Engine 1 asked again restores the same blocks from its own host tier: the same KV read by the same
        # suffix prefill must give engine 2's answer token for token. (Against the first answer, computed by a
        # whole-prompt prefill, only near-equality holds: a batch of a different shape sums in another order,
        # and on a CPU without AVX-512 that once flipped a greedy near-tie, "looks" for "appears".)
        third = httpx.post(engines[0] + "/v1/chat/completions", json=body, headers=salt, timeout=120).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert (third["usage"]["prompt_tokens_details"]["cached_tokens"]
                == second["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert second["choices"][0]["message"]["content"] == third["choices"][0]["message"]["content"]

        # A response stored through gateway 1 is served by gateway 2.
        question = {"model": MODEL, "max_tokens": 48,  # room to finish: "length" answers are never stored
                    "messages": [{"role": "user", "content": "Name the largest planet of the solar system."}]}
        stored = httpx.post(gateways[0] + "/v1/chat/completions", json=question, headers=auth, timeout=120)
        assert stored.status_code == 200 and stored.headers["x-kvgate-cache"] == "miss"
        deadline = time.monotonic() + 10
        while True:
            # no-store: a miss while gateway 2 has not seen the entry yet must not store an answer of its own,
            # which a later round would then serve instead of gateway 1's.
            served = httpx.post(gateways[1] + "/v1/chat/completions", json=question,
                                headers={**auth, "cache-control": "no-store"}, timeout=120)
            if served.headers.get("x-kvgate-cache") == "hit-exact" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert served.headers["x-kvgate-cache"] == "hit-exact"
        assert served.json()["choices"][0]["message"]["content"] == stored.json()["choices"][0]["message"]["content"]
