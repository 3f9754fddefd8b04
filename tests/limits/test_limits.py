"""Limits on keys and tenants through the openai SDK: requests, tokens and concurrent requests per
key and tenant, budgets (a cache hit is free), spend per key, and the same limits held by two
replicas sharing PostgreSQL and Redis."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis

from gateway.limits.settings import LimitsSettings
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.usage.settings import Price, UsageSettings
from tests.conftest import ADMIN_SECRET, CREATED_KEYS, Gateway, fresh_postgres_database, start_gateway

ADMIN = {"authorization": f"Bearer {ADMIN_SECRET}"}
REDIS_URL = "redis://127.0.0.1:6379/0"
# Dear enough that a few requests spend a budget: USD per million tokens.
PRICE = Price(input=1000.0, cached_input=100.0, output=2000.0)


def settings(**limits: object) -> dict[str, object]:
    return {"usage": UsageSettings(prices={"fake-model": PRICE}), "key_cache_ttl_s": 0.2,
            "responsecache": ResponseCacheSettings(semantic=False, poll_interval_s=0.1),
            "limits": LimitsSettings(**limits)}


@pytest.fixture(scope="module")
def gw(fake_upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    db = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('limits') / 'kvgate.db'}"
    gateways = start_gateway(fake_upstream, db, **settings())
    yield next(gateways)
    gateways.close()


def new_key(gw: Gateway, tenant: str | None = None, **limits: object) -> str:
    """A key made through the admin API, with these limits."""
    body = {"tenant": tenant or f"t-{secrets.token_hex(4)}", **limits}
    answer = httpx.post(gw.base_url + "/admin/keys", json=body, headers=ADMIN)
    assert answer.status_code == 201, answer.text
    key = answer.json()["key"]
    CREATED_KEYS.append(key)
    return key


def client(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)


def ask(client: openai.OpenAI, text: str | None = None, **extra: object) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": text or f"question {secrets.token_hex(6)}"}],
        extra_headers={"x-kvgate-semantic": "off"}, **extra)


def fresh_minute(needed_s: float = 15.0) -> None:
    """Per-minute limits count in clock minutes: start a test far enough from the next one."""
    left = 60 - time.time() % 60
    if left < needed_s:
        time.sleep(left + 0.05)


def test_a_key_over_its_rpm_gets_openais_429_with_retry_headers(gw: Gateway) -> None:
    fresh_minute()
    c = client(gw, new_key(gw, rpm=3))
    remaining = []
    for _ in range(3):
        raw = c.chat.completions.with_raw_response.create(
            model="fake-model", messages=[{"role": "user", "content": f"q {secrets.token_hex(4)}"}])
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(raw.headers["x-ratelimit-remaining-requests"])
    assert remaining == ["2", "1", "0"]
    with pytest.raises(openai.RateLimitError) as refused:
        ask(c)
    error = refused.value
    assert error.status_code == 429
    assert error.code == "rate_limit_exceeded"
    assert error.type == "requests"
    assert "requests per min (RPM): Limit 3, Used 3" in error.message
    assert 1 <= int(error.response.headers["retry-after"]) <= 60
    assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
    # A refused request counts nothing: still refused, still "Used 3".
    with pytest.raises(openai.RateLimitError, match="Used 3"):
        ask(c)


def test_the_sdk_waits_out_retry_after_and_succeeds_in_the_next_minute(gw: Gateway) -> None:
    left = 60 - time.time() % 60
    if left > 8:  # land near the end of a minute, so that the SDK's wait is short
        time.sleep(left - 6)
    key = new_key(gw, rpm=1)
    ask(client(gw, key))
    started = time.monotonic()
    # The SDK's default retries honour retry-after; the next minute admits it.
    answer = ask(openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=3))
    assert answer.choices[0].message.content.startswith("echo:")
    assert time.monotonic() - started < 30


def test_tokens_per_minute_are_charged_after_the_answer(gw: Gateway) -> None:
    fresh_minute()
    c = client(gw, new_key(gw, tpm=20))
    first = ask(c, "a question long enough to use up twenty tokens of this key's minute at once, surely")
    assert first.usage.total_tokens >= 20
    time.sleep(0.2)  # charged when the answer is logged, off the request's path
    with pytest.raises(openai.RateLimitError) as refused:
        ask(c)
    assert refused.value.type == "tokens"
    assert "tokens per min (TPM): Limit 20" in refused.value.message


def test_concurrent_requests_over_max_parallel_are_refused_until_one_finishes(gw: Gateway, fake_upstream: str) -> None:
    c = client(gw, new_key(gw, max_parallel=1))
    tag = secrets.token_hex(4)
    stream = c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hold on"}],
                                       stream=True, extra_body={"fake_fault": f"wait_signal:{tag}"})
    first = next(iter(stream))  # the stream is open: its lease is held
    assert first.choices[0].delta.role == "assistant"
    with pytest.raises(openai.RateLimitError) as refused:
        ask(c)
    assert "concurrent requests: Limit 1, Used 1" in refused.value.message
    assert refused.value.response.headers["retry-after"] == "1"
    httpx.post(f"{fake_upstream}/control/release/{tag}")
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    deadline = time.monotonic() + 5
    while True:  # the lease is released once the stream's last byte is sent
        try:
            ask(c)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the finished stream's lease was never released"
            time.sleep(0.05)


def test_a_tenant_limit_holds_for_all_its_keys_together(gw: Gateway) -> None:
    fresh_minute()
    tenant = f"t-{secrets.token_hex(4)}"
    answer = httpx.patch(f"{gw.base_url}/admin/tenants/{tenant}", json={"rpm": 2}, headers=ADMIN)
    assert answer.status_code == 200 and answer.json()["limits"]["rpm"] == 2, answer.text
    one, two = client(gw, new_key(gw, tenant)), client(gw, new_key(gw, tenant))
    ask(one)
    ask(two)
    with pytest.raises(openai.RateLimitError, match=f"tenant '{tenant}'"):
        ask(one)


def spend_of(gw: Gateway, prefix: str) -> dict[str, float]:
    rows = httpx.get(gw.base_url + "/admin/spend", params={"by": "key", "since": "1d"}, headers=ADMIN).json()["data"]
    mine = [r for r in rows if r["key"] == prefix]
    return {"cost": sum(r["cost_usd"] for r in mine), "saved": sum(r["saved_usd"] for r in mine),
            "requests": sum(r["requests"] for r in mine), "hits": sum(r["cache_hits"] for r in mine)}


def cost(usage: object) -> float:
    cached = usage.prompt_tokens_details.cached_tokens or 0  # type: ignore[attr-defined]
    return ((usage.prompt_tokens - cached) * PRICE.input + cached * PRICE.cached_input  # type: ignore[attr-defined]
            + usage.completion_tokens * PRICE.output) / 1e6  # type: ignore[attr-defined]


def wait_for(condition: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_key_over_its_budget_gets_insufficient_quota_and_a_cache_hit_is_free(gw: Gateway) -> None:
    key = new_key(gw, budget_usd=0.1, budget_period="30d")
    c = client(gw, key)
    first = ask(c, "what does a budget of ten cents buy?")
    spent = cost(first.usage)
    assert spent > 0.01
    wait_for(lambda: spend_of(gw, key[:12])["requests"] == 1)
    hit = c.chat.completions.with_raw_response.create(
        model="fake-model", messages=[{"role": "user", "content": "what does a budget of ten cents buy?"}],
        extra_headers={"x-kvgate-semantic": "off"})
    assert hit.headers["x-kvgate-cache"] == "hit-exact"
    wait_for(lambda: spend_of(gw, key[:12])["requests"] == 2)
    after_hit = spend_of(gw, key[:12])
    assert after_hit["cost"] == pytest.approx(spent)  # the hit cost nothing
    assert after_hit["hits"] == 1 and after_hit["saved"] >= spent
    admitted = 2
    with pytest.raises(openai.RateLimitError) as refused:
        for _ in range(20):
            ask(c)
            admitted += 1
            time.sleep(0.05)  # charged when logged
    error = refused.value
    assert error.code == "insufficient_quota" and error.type == "insufficient_quota"
    assert "budget" in error.message and "$0.1" in error.message
    assert error.response.headers["x-should-retry"] == "false"
    wait_for(lambda: spend_of(gw, key[:12])["requests"] == admitted)  # every admitted request logged
    total = spend_of(gw, key[:12])["cost"]
    # Refused once the spend reached the budget: never a request after it.
    assert total >= 0.1 and total - 0.1 < spent * 1.5
    listed = httpx.get(gw.base_url + "/admin/keys", headers=ADMIN).json()["data"]
    [mine] = [k for k in listed if k["prefix"] == key[:12]]
    assert mine["budget"]["exhausted"] is True and mine["budget"]["period"] == "30d"
    assert mine["budget"]["spent_usd"] == pytest.approx(total, rel=1e-6)


def test_bad_limits_are_refused_with_a_clear_error(gw: Gateway) -> None:
    for body, param in (({"tenant": "x", "rpm": 0}, "rpm"), ({"tenant": "x", "rpm": 1.5}, "rpm"),
                        ({"tenant": "x", "tpm": 10**12}, "tpm"),
                        ({"tenant": "x", "budget_usd": 5, "budget_period": "monthly"}, "budget_period")):
        answer = httpx.post(gw.base_url + "/admin/keys", json=body, headers=ADMIN)
        assert answer.status_code == 422 and answer.json()["error"]["param"] == param, answer.text
    answer = httpx.post(gw.base_url + "/admin/keys", json={"tenant": "x"}, headers={"authorization": "Bearer nope"})
    assert answer.status_code == 401
    # A NUL in the tenant filter: the client's error (PostgreSQL would refuse it as a 500).
    answer = httpx.get(gw.base_url + "/admin/keys", params={"tenant": "a\x00b"}, headers=ADMIN)
    assert answer.status_code == 422 and answer.json()["error"]["param"] == "query.tenant", answer.text


@pytest.fixture
def two_replicas(fake_upstream: str) -> Iterator[tuple[Gateway, Gateway]]:
    prefix = f"kvgate-test:{secrets.token_hex(4)}:limits:"
    with fresh_postgres_database() as url:
        one = start_gateway(fake_upstream, url, **settings(redis_url=REDIS_URL, redis_prefix=prefix))
        two = start_gateway(fake_upstream, url, **settings(redis_url=REDIS_URL, redis_prefix=prefix))
        try:
            yield next(one), next(two)
        finally:
            one.close()
            two.close()
            r = redis.Redis.from_url(REDIS_URL)
            for name in r.scan_iter(prefix + "*"):
                r.delete(name)


def alternate(one: Gateway, two: Gateway, key: str, requests: int) -> list[str]:
    """Send `requests` requests of `key`, 8 at a time, alternating between two replicas: each one's
    outcome, `ok0` / `ok1` (admitted by the first or second) or `429`."""
    clients = [client(one, key), client(two, key)]
    outcomes: list[str] = []
    lock = threading.Lock()

    def send(i: int) -> None:
        try:
            ask(clients[i % 2])
            result = f"ok{i % 2}"
        except openai.RateLimitError:
            result = "429"
        with lock:
            outcomes.append(result)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, range(requests)))
    return outcomes


def test_two_replicas_sharing_postgres_and_redis_hold_one_rpm(two_replicas: tuple[Gateway, Gateway]) -> None:
    one, two = two_replicas
    fresh_minute(30)
    outcomes = alternate(one, two, new_key(one, rpm=20), 60)
    admitted = sum(o.startswith("ok") for o in outcomes)
    print(f"rpm 20 over two replicas: {admitted} of 60 admitted "
          f"({outcomes.count('ok0')} by one, {outcomes.count('ok1')} by the other)")
    assert 18 <= admitted <= 22, outcomes  # the limit holds across both replicas within 10%
    assert outcomes.count("ok0") > 0 and outcomes.count("ok1") > 0


def test_a_budget_survives_a_restart_and_holds_on_the_other_replica(two_replicas: tuple[Gateway, Gateway]) -> None:
    one, two = two_replicas
    key = new_key(one, budget_usd=0.05)
    with pytest.raises(openai.RateLimitError):
        for _ in range(20):
            ask(client(one, key))
            time.sleep(0.05)
    # The other replica refuses it too: its count is the shared one.
    with pytest.raises(openai.RateLimitError) as refused:
        ask(client(two, key))
    assert refused.value.code == "insufficient_quota"
    # Redis forgets (a restart without persistence): the spend is read back from the request log, once
    # its writers have written what they hold (rows wait a moment in each replica's queue).
    for gateway in (one, two):
        wait_for(lambda g=gateway: "\nkvgate_request_log_queued_rows 0.0\n"
                 in httpx.get(g.base_url + "/metrics", headers=ADMIN).text)
    r = redis.Redis.from_url(REDIS_URL)
    prefix = two.settings.limits.redis_prefix
    for name in r.scan_iter(prefix + "*"):
        r.delete(name)
    with pytest.raises(openai.RateLimitError) as refused:
        ask(client(two, key))
    assert refused.value.code == "insufficient_quota"


def test_spend_is_readable_per_key_tenant_model_and_day(gw: Gateway, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main

    tenant = f"t-{secrets.token_hex(4)}"
    key = new_key(gw, tenant, budget_usd=50)
    c = client(gw, key)
    spent = sum(cost(ask(c).usage) for _ in range(3))
    wait_for(lambda: spend_of(gw, key[:12])["requests"] == 3)
    by_tenant = httpx.get(gw.base_url + "/admin/spend", params={"by": "tenant", "tenant": tenant},
                          headers=ADMIN).json()
    assert [r["tenant"] for r in by_tenant["data"]] == [tenant]
    assert by_tenant["total_cost_usd"] == pytest.approx(spent, rel=1e-6)
    by_model = httpx.get(gw.base_url + "/admin/spend", params={"by": "model", "tenant": tenant}, headers=ADMIN).json()
    assert by_model["data"][0]["model"] == "fake-model" and by_model["data"][0]["requests"] == 3
    assert httpx.get(gw.base_url + "/admin/spend", params={"by": "colour"}, headers=ADMIN).status_code == 422
    assert httpx.get(gw.base_url + "/admin/spend", headers={"authorization": f"Bearer {key}"}).status_code == 403
    # The dashboard's keys table: spend, limits and the budget's state.
    summary = httpx.get(gw.base_url + "/dashboard/api/summary", headers=ADMIN).json()
    [row] = [r for r in summary["keys"] if r["key"] == key[:12]]
    assert row["tenant"] == tenant and row["cost_usd"] == pytest.approx(spent, rel=1e-6)
    assert row["budget"]["spent_usd"] == pytest.approx(spent, rel=1e-6) and row["limits"] == "$50/lifetime"
    # kvgate stats, from the same request log.
    assert main(["stats", "--since", "1h", "--json", "--database-url", gw.database_url]) == 0
    stats = json.loads(capsys.readouterr().out)
    [mine] = [r for r in stats["spend"]["by_key"] if r["key"] == key[:12]]
    assert mine["cost_usd"] == pytest.approx(spent, rel=1e-6) and mine["requests"] == 3
    assert mine["days"][0]["day"] == time.strftime("%Y-%m-%d", time.gmtime())
    assert main(["stats", "--since", "1h", "--database-url", gw.database_url]) == 0
    text = capsys.readouterr().out
    assert "spend at the configured prices" in text and key[:12] in text and tenant in text


def test_anthropics_route_refuses_in_anthropics_envelope(gw: Gateway) -> None:
    import anthropic

    fresh_minute()
    key = new_key(gw, rpm=1)
    ask(client(gw, key))
    claude = anthropic.Anthropic(base_url=gw.base_url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as refused:
        claude.messages.create(model="fake-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert "requests per min (RPM): Limit 1" in body["error"]["message"]
    assert refused.value.response.headers["retry-after"]
