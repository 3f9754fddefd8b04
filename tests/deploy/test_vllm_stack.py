"""The vLLM overlay (deploy/compose.vllm.yml), built and running: two vLLM CPU servers with kvgate's KV
connector sharing the compose Redis as their KV tier, behind the gateway (routing on their KV events)
and the load balancer. A conversation's next turn comes back cached on the server that holds it, and
after that server is killed, cached again on the other one, which loads the blocks from Redis.

Needs KVGATE_DEPLOY_TEST=1 and KVGATE_VLLM=1 (the vLLM image: about 900 MB of wheels, a 3-4 GB image,
servers that compile for 2-3 minutes at start):
    KVGATE_DEPLOY_TEST=1 KVGATE_VLLM=1 .venv/bin/python -m pytest -s tests/deploy/test_vllm_stack.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.stack import LONG_MANUAL as MANUAL
from tests.deploy.stack import ROOT, Stack, docker_unavailable, eventually

FILES = ("docker-compose.yml", "deploy/compose.vllm.yml", "deploy/compose.test.yml")
SERVERS = ("vllm-1", "vllm-2")
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def vllm_stack() -> Iterator[Stack]:
    reason = docker_unavailable()
    if reason:
        pytest.skip(reason)
    if os.environ.get("KVGATE_VLLM") != "1":
        pytest.skip("the vLLM overlay was not requested: set KVGATE_VLLM=1 (builds the vLLM image)")
    stack = Stack("kvgatedeployvllm", FILES)
    stack.compose("down", "-v", "--remove-orphans", check=False)
    start = time.monotonic()
    built = subprocess.run([str(ROOT / "deploy" / "build-images")], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, PYTHON=sys.executable, KVGATE_VLLM="1"), timeout=3600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    sizes = [line.removeprefix("build-images: ") for line in built.stdout.splitlines() if " size " in line]
    stack.log("vllm-build", time.monotonic() - start, f"({'; '.join(sizes)})")
    try:
        start = time.monotonic()
        stack.compose("up", "-d", "--no-build")
        eventually(lambda: stack.healthy("gateway") and httpx.get(stack.lb_url + "/readyz", timeout=5).status_code
                   == 200, 900, "vLLM servers and the gateway healthy behind the load balancer")
        stack.log("vllm-up", time.monotonic() - start, "(2 vLLM servers, 2 engines, gateway, lb, redis, postgres)")
        yield stack
    except BaseException:
        print(stack.logs())
        print(subprocess.run(["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={stack.project}",
                              "--format", "{{.ID}} {{.Names}} {{.Status}}"], capture_output=True, text=True).stdout)
        raise
    finally:
        stack.compose("down", "-v", "--remove-orphans", check=False)


def server_metrics(stack: Stack, server: str) -> dict[str, float]:
    """Sums of a vLLM server's counters by sample name (its port is on the compose network only)."""
    text = httpx.get(f"http://{stack.address(stack.container(server))}:8000/metrics", timeout=10).text
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def answered(stack: Stack) -> dict[str, float]:
    return {s: server_metrics(stack, s).get("vllm:request_success_total", 0.0) for s in SERVERS}


def turn(sdk: openai.OpenAI, messages: list[dict[str, str]]) -> Any:
    return sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,  # type: ignore[arg-type]
                                       extra_headers={"cache-control": "no-cache, no-store"})


def test_a_conversation_continues_cached_after_its_server_is_killed(vllm_stack: Stack) -> None:
    stack = vllm_stack
    sdk = openai.OpenAI(base_url=stack.lb_url + "/v1", api_key=stack.admin_key, max_retries=2, timeout=300)
    messages = [{"role": "system", "content": f"{uuid.uuid4().hex} {MANUAL}"},
                {"role": "user", "content": "Where is the reset button?"}]
    before = answered(stack)
    first = turn(sdk, messages)
    after = answered(stack)
    server = next(s for s in SERVERS if after[s] > before[s])
    other = next(s for s in SERVERS if s != server)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "How long do I hold it?"}]
    second = turn(sdk, messages)
    kept = second.usage.prompt_tokens_details.cached_tokens
    print(f"deploy: vllm second turn on {server}: cached_tokens={kept} of {second.usage.prompt_tokens}")
    assert answered(stack)[server] == after[server] + 1, "the second turn left the server that holds it"
    assert kept >= 0.9 * first.usage.prompt_tokens

    # The blocks reach the Redis tier off the forward path (a niced writer thread): wait until the
    # fleet's Redis database holds the first prompt's full blocks (32 tokens each).
    def redis_blocks() -> int:
        return int(stack.compose("exec", "-T", "redis", "redis-cli", "-n", "3", "dbsize").stdout.strip() or 0)

    eventually(lambda: redis_blocks() >= first.usage.prompt_tokens // 32, 60, f"{server}'s blocks in Redis")
    subprocess.run(["docker", "kill", stack.container(server)], check=True, capture_output=True)
    killed_at = time.monotonic()
    messages += [{"role": "assistant", "content": second.choices[0].message.content or ""},
                 {"role": "user", "content": "Will it erase my settings?"}]
    third = turn(sdk, messages)
    moved = third.usage.prompt_tokens_details.cached_tokens
    loaded = server_metrics(stack, other).get("vllm:kvgate_loaded_blocks_total", 0)
    stack.log("vllm-kill", time.monotonic() - killed_at,
              f"(killed {server}; the next turn on {other}: cached_tokens {moved} of {third.usage.prompt_tokens}, "
              f"{loaded:.0f} blocks loaded from kvgate's tiers)")
    assert moved >= 0.9 * second.usage.prompt_tokens and loaded > 0
