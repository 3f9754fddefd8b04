"""The engines' KV tier on a three-master Redis Cluster (deploy/compose.redis-cluster.yml), exercised
through the engines: a prefix computed by engine-1 is restored by engine-2 from the cluster.

Run by `.ci/run` after tests/deploy/test_stack.py, on the images that test built:
    KVGATE_DEPLOY_TEST=1 .venv/bin/python -m pytest -s tests/deploy/test_redis_cluster.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.deploy.stack import MODEL, ROOT, Stack, docker_unavailable, eventually, write_behind_settled
from tests.deploy.test_stack import MANUAL

FILES = ("docker-compose.yml", "deploy/compose.redis-cluster.yml", "deploy/compose.test.yml")
NODES = ("redis-node-1", "redis-node-2", "redis-node-3")


@pytest.fixture(scope="module")
def cluster_stack() -> Iterator[Stack]:
    reason = docker_unavailable()
    if reason:
        pytest.skip(reason)
    stack = Stack("kvgatedeploycluster", FILES, KVGATE_REDIS_IMAGE="kvgate-deps/redis:bookworm")
    stack.compose("down", "-v", "--remove-orphans", check=False)
    built = subprocess.run([str(ROOT / "deploy" / "build-images")], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, PYTHON=sys.executable), timeout=1800)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    try:
        start = time.monotonic()
        stack.compose("up", "-d", "--no-build", "engine-1", "engine-2")
        eventually(lambda: stack.healthy("engine-1") and stack.healthy("engine-2"), 300, "both engines healthy")
        stack.log("cluster-up", time.monotonic() - start, "(3 cluster nodes, cluster created, 2 engines healthy)")
        yield stack
    except BaseException:
        print(stack.logs())
        raise
    finally:
        start = time.monotonic()
        stack.compose("down", "-v", "--remove-orphans", check=False)
        stack.log("cluster-down", time.monotonic() - start)


def engine_url(stack: Stack, service: str) -> str:
    ip = subprocess.run(["docker", "inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                         stack.container(service)], capture_output=True, text=True, check=True).stdout.strip()
    return f"http://{ip}:8081/v1/chat/completions"


def node_keys(stack: Stack, node: str) -> int:
    out = subprocess.run(["docker", "exec", stack.container(node), "redis-cli", "dbsize"], capture_output=True,
                         text=True, check=True).stdout
    return int(out.strip())


def test_engines_share_kv_through_the_cluster(cluster_stack: Stack) -> None:
    stack = cluster_stack
    info = subprocess.run(["docker", "exec", stack.container("redis-node-1"), "redis-cli", "cluster", "info"],
                          capture_output=True, text=True, check=True).stdout
    assert "cluster_state:ok" in info and "cluster_known_nodes:3" in info, info
    single = subprocess.run(["docker", "exec", stack.container("redis"), "redis-cli", "-n", "0", "dbsize"],
                            capture_output=True, text=True, check=True).stdout.strip()

    body = {"model": MODEL, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": MANUAL + uuid.uuid4().hex},
                         {"role": "user", "content": "Summarise the manual."}]}
    salt = {"x-kvgate-cache-salt": "deploy-cluster-test"}
    first = httpx.post(engine_url(stack, "engine-1"), json=body, headers=salt, timeout=180).json()
    engine_1 = engine_url(stack, "engine-1").removesuffix("/v1/chat/completions")
    eventually(lambda: write_behind_settled(engine_1), 60, "engine-1's write-behind store in the cluster")
    second = httpx.post(engine_url(stack, "engine-2"), json=body, headers=salt, timeout=180).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reused = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    keys = {node: node_keys(stack, node) for node in NODES}
    print(f"deploy: cluster engine-2 restored {reused} of {second['usage']['prompt_tokens']} prompt tokens; "
          f"keys per node {keys}; single redis db0 keys {single}")
    assert reused > 64
    assert sum(1 for count in keys.values() if count > 0) >= 2, "blocks spread over the cluster's slots"
    assert single == "0", "the single Redis holds no KV blocks"
