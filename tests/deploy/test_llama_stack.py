"""The llama.cpp overlay (deploy/compose.llama.yml), built and running: two llama-server containers
behind the gateway and the load balancer, each slot saved into kvgate's tiers after every turn. A
conversation's next turn comes back to the slot that holds it; after that server is SIGKILLed, the
turn after goes to the other server, which gets the slot restored from the tiers and reports the
restored tokens as cached (docs/llamacpp.md).

Needs KVGATE_DEPLOY_TEST=1 and KVGATE_LLAMA=1 (the llama-server image compiles llama.cpp from source:
about 5 minutes on two cores the first time, cached by Docker after):
    KVGATE_DEPLOY_TEST=1 KVGATE_LLAMA=1 .venv/bin/python -m pytest -s tests/deploy/test_llama_stack.py
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

FILES = ("docker-compose.yml", "deploy/compose.llama.yml", "deploy/compose.test.yml")
SERVERS = ("llama-1", "llama-2")
MODEL = "smollm2-135m-q4"


def llama_unavailable() -> str | None:
    """Why the llama.cpp overlay cannot run here, or None when it can."""
    reason = docker_unavailable()
    if reason:
        return reason
    if os.environ.get("KVGATE_LLAMA") != "1":
        return ("the llama.cpp overlay was not requested: set KVGATE_LLAMA=1 (builds the llama-server image, "
                "llama.cpp from source: about 5 minutes on two cores, once)")
    with open("/proc/cpuinfo") as cpuinfo:
        if " avx2" not in cpuinfo.read():
            return "this CPU lacks AVX2, which the llama-server image is built for (LLAMA_CMAKE_ARGS)"
    return None


@pytest.fixture(scope="module")
def llama_stack() -> Iterator[Stack]:
    reason = llama_unavailable()
    if reason:
        pytest.skip(reason)
    stack = Stack("kvgatedeployllama", FILES)
    stack.compose("down", "-v", "--remove-orphans", check=False)
    start = time.monotonic()
    built = subprocess.run([str(ROOT / "deploy" / "build-images")], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, PYTHON=sys.executable, KVGATE_LLAMA="1"), timeout=3600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    steps = [line.removeprefix("build-images: ") for line in built.stdout.splitlines() if "llama" in line]
    stack.log("llama-build", time.monotonic() - start, f"({'; '.join(steps)})")
    try:
        start = time.monotonic()
        stack.compose("up", "-d", "--no-build")
        eventually(lambda: stack.healthy("gateway") and httpx.get(stack.lb_url + "/readyz", timeout=5).status_code
                   == 200, 600, "llama servers and the gateway healthy behind the load balancer")
        stack.log("llama-up", time.monotonic() - start, "(2 llama-servers, 2 engines, gateway, lb, redis, postgres)")
        yield stack
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.compose("down", "-v", "--remove-orphans", check=False)


def saved(stack: Stack, server: str) -> float:
    """Slots of `server` the gateway saved into its tiers (through the load balancer: one replica)."""
    text = stack.metrics(stack.lb_url)
    return sum(s.value for family in text_string_to_metric_families(text) if family.name == "kvgate_slot_saves"
               for s in family.samples if s.labels == {"upstream": server, "outcome": "saved"})


def turn(sdk: openai.OpenAI, messages: list[dict[str, str]]) -> tuple[str, Any]:
    """(where it ran, as `x-kvgate-kv-slot` says: "llama-2#1; restored=host"), the completion."""
    raw = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=16,  # type: ignore[arg-type]
                                                        temperature=0,
                                                        extra_headers={"cache-control": "no-cache, no-store"})
    return raw.headers.get("x-kvgate-kv-slot", ""), raw.parse()


def test_a_conversation_continues_from_the_tiers_after_its_server_is_killed(llama_stack: Stack) -> None:
    stack = llama_stack
    sdk = openai.OpenAI(base_url=stack.lb_url + "/v1", api_key=stack.admin_key, max_retries=2, timeout=300)
    messages = [{"role": "system", "content": f"{uuid.uuid4().hex} {MANUAL}"},
                {"role": "user", "content": "Where is the reset button?"}]
    where, first = turn(sdk, messages)
    server = where.split("#")[0]
    assert server in SERVERS, where
    other = next(s for s in SERVERS if s != server)
    eventually(lambda: saved(stack, server) >= 1, 60, f"{server}'s slot saved after the first turn")
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "How long do I hold it?"}]
    where2, second = turn(sdk, messages)
    kept = second.usage.prompt_tokens_details.cached_tokens
    print(f"deploy: llama second turn on {where2}: cached_tokens={kept} of {second.usage.prompt_tokens}")
    assert where2.split("#")[0] == server, (where, where2)
    assert kept >= 0.9 * first.usage.prompt_tokens
    eventually(lambda: saved(stack, server) >= 2, 60, f"{server}'s slot saved after the second turn")

    subprocess.run(["docker", "kill", stack.container(server)], check=True, capture_output=True)
    killed_at = time.monotonic()
    messages += [{"role": "assistant", "content": second.choices[0].message.content or ""},
                 {"role": "user", "content": "Will it erase my settings?"}]
    where3, third = turn(sdk, messages)
    moved = third.usage.prompt_tokens_details.cached_tokens
    stack.log("llama-kill", time.monotonic() - killed_at,
              f"(killed {server}; the next turn on {where3}: cached_tokens {moved} of {third.usage.prompt_tokens})")
    assert where3.split("#")[0] == other and "restored=" in where3, where3
    assert moved >= 0.9 * third.usage.prompt_tokens, third.usage
    assert third.choices[0].message.content
