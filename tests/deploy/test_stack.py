"""The compose stack, built and running: kvgate's real images (kvgate for the gateway and migrate,
kvgate-engine for the engines), Debian-made PostgreSQL, Redis and Prometheus (deploy/compose.test.yml),
driven through the gateway with the openai SDK.

Run by `.ci/run` as its own step when Docker answers (KVGATE_DEPLOY_TEST=1; it builds images and
starts containers for several minutes, so the ordinary pytest run skips it with the reason):
    KVGATE_DEPLOY_TEST=1 .venv/bin/python -m pytest -s tests/deploy/test_stack.py
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from typing import Any

import httpx
import openai

from tests.deploy.stack import ENGINES, ENV_FILE_MAX_BODY_BYTES, MODEL, Stack, eventually, write_behind_settled

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "How do I reset the password of my wifi router?"
PARAPHRASE = "How can I reset my wifi router password?"
# A long shared prefix, so that the engine's KV blocks (16 tokens) cover a second turn.
MANUAL = ("You are the support assistant of a home network company. Routers have a reset button on the "
          "back; holding it for ten seconds restores the factory settings, including the wifi password "
          "printed on the label underneath. ") * 4


def client(stack: Stack, base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=stack.admin_key, max_retries=0, timeout=180)


def chat(sdk: openai.OpenAI, messages: list[dict[str, str]], **kwargs: Any) -> tuple[str, Any]:
    raw = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                         temperature=0, **kwargs)
    return raw.headers.get("x-kvgate-cache", ""), raw.parse()


def ask(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def entries(stack: Stack, base_url: str) -> int:
    stats = httpx.get(base_url + "/admin/response-cache/stats",
                      headers={"authorization": f"Bearer {stack.admin_key}"}, timeout=10)
    stats.raise_for_status()
    return int(stats.json()["entries"])


def metric(text: str, name: str, upstream: str) -> float:
    found = re.search(rf'^{name}\{{upstream="{upstream}"\}} (\S+)$', text, re.MULTILINE)
    assert found, f"{name} for {upstream} not exported"
    return float(found.group(1))


def test_miss_exact_semantic_and_kv_reuse(stack: Stack) -> None:
    url = stack.lb_url  # what a client is given: the load balancer's address
    sdk = client(stack, url)
    start = time.monotonic()
    cache, first = chat(sdk, ask(QUESTION), max_tokens=200)
    stack.log("first-answer", time.monotonic() - start, f"(miss, {first.usage.completion_tokens} tokens)")
    assert cache == "miss" and first.choices[0].finish_reason == "stop", (cache, first.choices[0])
    eventually(lambda: entries(stack, url) >= 1, 30, "the answer stored in the response cache")

    cache, exact = chat(sdk, ask(QUESTION), max_tokens=200)
    assert cache == "hit-exact" and exact.choices[0].message.content == first.choices[0].message.content
    assert exact.usage.prompt_tokens_details.cached_tokens == exact.usage.prompt_tokens
    cache, semantic = chat(sdk, ask(PARAPHRASE), max_tokens=200)
    assert cache == "hit-semantic" and semantic.choices[0].message.content == first.choices[0].message.content

    # KV reuse: the second turn of a conversation starts with the first turn's prompt.
    turn = [{"role": "system", "content": MANUAL}, {"role": "user", "content": "Where is the reset button?"}]
    cache, one = chat(sdk, turn, max_tokens=24, extra_headers={"cache-control": "no-cache, no-store"})
    assert cache == "bypass" and one.usage.prompt_tokens > 64
    turn += [{"role": "assistant", "content": one.choices[0].message.content or ""},
             {"role": "user", "content": "And how long do I hold it?"}]
    cache, two = chat(sdk, turn, max_tokens=24, extra_headers={"cache-control": "no-cache, no-store"})
    reused = two.usage.prompt_tokens_details.cached_tokens
    print(f"deploy: kv-reuse second turn cached_tokens={reused} of prompt_tokens={two.usage.prompt_tokens}")
    assert cache == "bypass" and reused >= one.usage.prompt_tokens // 16 * 16 - 16 > 0


def test_engines_share_the_redis_kv_tier(stack: Stack) -> None:
    """A prefix computed by engine-1 is restored by engine-2 (asked directly, same tenant salt)."""
    def address(service: str) -> str:
        return f"http://{stack.address(stack.container(service))}:8081"

    body = {"model": MODEL, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": MANUAL + uuid.uuid4().hex},
                         {"role": "user", "content": "Summarise the manual."}]}
    salt = {"x-kvgate-cache-salt": "deploy-test"}
    first = httpx.post(address("engine-1") + "/v1/chat/completions", json=body, headers=salt, timeout=180).json()
    eventually(lambda: write_behind_settled(address("engine-1")), 60, "engine-1's write-behind store in Redis")
    second = httpx.post(address("engine-2") + "/v1/chat/completions", json=body, headers=salt, timeout=180).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reused = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    print(f"deploy: shared-kv engine-2 restored {reused} of {second['usage']['prompt_tokens']} prompt tokens")
    assert reused > 64


def test_prometheus_scrapes_gateway_and_engines(stack: Stack) -> None:
    start = time.monotonic()
    targets = eventually(lambda: len(stack.prometheus('up{job=~"kvgate-.*"} == 1')) == 3 and 3, 90,
                         "prometheus sees the gateway and both engines up")
    # The first test made five chat requests on this replica: a miss, two hits, two bypassing turns; the
    # second asked each engine directly. Each check waits for the scrape that shows all of it (a busy
    # machine scrapes one target before another).
    def requests_by_cache() -> dict[str, float] | None:
        found = {r["metric"].get("cache", ""): float(r["value"][1])
                 for r in stack.prometheus("sum by (cache) (kvgate_requests_total)")}
        return found if sum(found.values()) >= 5 else None

    requests = eventually(requests_by_cache, 90, "kvgate_requests_total scraped with the first test's requests")
    lookups = eventually(lambda: (found := stack.prometheus("kvgate_kv_lookups_total > 0")) and len(found) == 2
                         and found, 90, "KV lookups scraped from both engines")
    stack.log("prometheus", time.monotonic() - start, f"({targets} targets up, requests by cache {requests}, "
              f"KV lookups on {len(lookups)} engines)")
    assert sum(requests.values()) >= 5 and len(lookups) == 2


def test_scale_gateway_to_three_replicas(stack: Stack) -> None:
    start = time.monotonic()
    stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "gateway=3")
    urls = eventually(lambda: stack.healthy("gateway") and len(stack.gateway_urls()) == 3 and stack.gateway_urls(),
                      180, "three healthy gateway replicas")
    stack.log("scale", time.monotonic() - start, "(gateway=3, healthy)")
    answers = set()
    for url in urls:
        cache, exact = chat(client(stack, url), ask(QUESTION), max_tokens=200)
        assert cache == "hit-exact", (url, cache)
        cache, semantic = chat(client(stack, url), ask(PARAPHRASE), max_tokens=200)
        assert cache == "hit-semantic", (url, cache)
        answers |= {exact.choices[0].message.content, semantic.choices[0].message.content}
    assert len(answers) == 1, "every replica serves the one stored answer"


def test_engine_killed_mid_stream_then_recovery(stack: Stack) -> None:
    url = stack.gateway_urls()[0]
    sdk = client(stack, url)
    story = ask(f"Write a long story about a lighthouse keeper. ({uuid.uuid4().hex})")
    stream = sdk.chat.completions.create(model=MODEL, messages=story, temperature=0, max_tokens=400,  # type: ignore[arg-type]
                                         stream=True)
    received, killed, error = 0, "", None
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
            if received == 3 and not killed:
                text = stack.metrics(url)
                killed = next(e for e in ENGINES if metric(text, "kvgate_upstream_in_flight_requests", e) >= 1)
                subprocess.run(["docker", "kill", stack.container(killed)], check=True, capture_output=True)
                killed_at = time.monotonic()
    except openai.APIError as exc:
        error = exc
    assert killed, "the stream ended before an engine could be killed"
    assert error is not None, f"the stream ended normally after {received} chunks though {killed} was killed"
    print(f"deploy: kill {killed} after {received} chunks -> {type(error).__name__}: {error}")

    # Recovery without the killed engine: the router fails over to the other one.
    cache, answer = chat(sdk, ask(f"Name a colour. ({uuid.uuid4().hex})"), max_tokens=16)
    assert cache == "miss" and answer.choices[0].message.content
    # The broken stream was not cached: asking it again goes to an engine.
    again = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=story, temperature=0,  # type: ignore[arg-type]
                                                          max_tokens=8)
    assert again.headers.get("x-kvgate-cache") == "miss"
    stack.log("kill", time.monotonic() - killed_at, f"(killed {killed}; {error.__class__.__name__}; next request "
              "served by the other engine)")

    # The killed engine comes back (compose starts it again) and the router takes it back.
    start = time.monotonic()
    state = stack.state(stack.container(killed))
    policy = f"running={state['Running']} after the restart policy"
    stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "gateway=3")
    eventually(lambda: stack.healthy(killed), 180, f"{killed} healthy again")
    eventually(lambda: all(metric(stack.metrics(u), "kvgate_upstream_up", killed) == 1
                           for u in stack.gateway_urls()), 60, f"every gateway routes to {killed} again")
    stack.log("recover", time.monotonic() - start, f"({killed} healthy and up in every router; {policy})")
    cache, answer = chat(sdk, ask(f"Name an animal. ({uuid.uuid4().hex})"), max_tokens=16)
    assert cache == "miss" and answer.choices[0].message.content


def test_env_file_reaches_the_gateway_and_keys_are_created_in_the_stack(stack: Stack) -> None:
    """The env file (a user's .env) reaches the gateway, not only the variables compose names; the
    README's one-liner creates a tenant key in the stack's PostgreSQL that the gateway accepts
    (issue 44, item 4)."""
    created = stack.compose("exec", "-T", "gateway", "kvgate", "keys", "create", "--tenant", "t1")
    key = created.stdout.strip()
    assert key.startswith("kvg-") and created.stdout == key + "\n", created.stdout
    assert "kvgate: database postgresql+asyncpg://kvgate:***@postgres:5432/kvgate" in created.stderr.splitlines()
    url = stack.lb_url
    sdk = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    assert MODEL in [m.id for m in sdk.models.list()]
    padding = b"x" * ENV_FILE_MAX_BODY_BYTES
    too_big = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                         content=b'{"model": "' + MODEL.encode() + b'", "messages": [], "pad": "' + padding + b'"}')
    assert too_big.status_code == 413 and str(ENV_FILE_MAX_BODY_BYTES) in too_big.text
