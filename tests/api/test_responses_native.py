"""The Responses API forwarded unchanged to an upstream that speaks it (`"responses_api": true`):
the openai SDK, JSON and streaming, the provider's own usage, exact hits, tenants, single-flight."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from gateway.responsecache.settings import ResponseCacheSettings
from gateway.settings import UpstreamSettings
from tests.api.conftest import count, entries, wait_stored
from tests.conftest import Gateway, new_key, start_gateway
from tests.fake_responses import MODEL, create_fake_responses
from tests.servers import serve_in_thread


@pytest.fixture(scope="module")
def fake() -> Iterator[str]:
    with serve_in_thread(create_fake_responses()) as url:
        yield url


@pytest.fixture(scope="module")
def rgw(fake: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('native-responses') / 'kvgate.db'}"
    upstream = UpstreamSettings(name="responses", base_url=fake + "/v1", responses_api=True, read_timeout_s=5)
    gateways = start_gateway(fake, url, upstreams=[upstream],
                             responsecache=ResponseCacheSettings(semantic=False, poll_interval_s=0.1))
    yield next(gateways)
    gateways.close()


def sdk(gateway: Gateway, key: str | None = None) -> OpenAI:
    return OpenAI(base_url=gateway.v1, api_key=key or gateway.api_key, max_retries=0)


def test_forwarded_json_and_stream_with_the_providers_usage(rgw: Gateway, fake: str) -> None:
    client = sdk(rgw)
    before, stored = count(fake), entries(rgw)
    raw = client.responses.with_raw_response.create(model=MODEL, input="native question one",
                                                    instructions="shared instructions here", store=False)
    first = raw.parse()
    assert raw.headers["x-kvgate-cache"] == "miss" and raw.headers["x-kvgate-usage-source"] == "upstream"
    sent = httpx.get(fake + "/control/state").json()["last_request"]
    assert sent["input"] == "native question one" and sent["store"] is False, "the body went as it was"
    assert first.output_text == "echo: native question one" and first.model_extra["vendor_field"] == "kept"
    assert first.usage.input_tokens_details.cached_tokens == 0
    wait_stored(rgw, stored + 1)

    with client.responses.stream(model=MODEL, input="native question two",
                                 instructions="shared instructions here") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        streamed = stream.get_final_response()
    assert text == "echo: native question two" == streamed.output_text
    assert streamed.usage.input_tokens_details.cached_tokens == 3, "the provider's prefix-cache read"
    wait_stored(rgw, stored + 2)

    for stream_it in (False, True):
        raw = client.responses.with_raw_response.create(model=MODEL, input="native question one",
                                                        instructions="shared instructions here", stream=stream_it)
        assert raw.headers["x-kvgate-cache"] == "hit-exact"
        if stream_it:
            events = list(raw.parse())
            assert events[-1].type == "response.completed"
            hit = events[-1].response
        else:
            hit = raw.parse()
        assert hit.output_text == "echo: native question one"
        assert hit.usage.input_tokens_details.cached_tokens == hit.usage.input_tokens == first.usage.input_tokens
    assert count(fake) == before + 2

    other = sdk(rgw, new_key(rgw.database_url, "team-native-responses"))
    raw = other.responses.with_raw_response.create(model=MODEL, input="native question one",
                                                   instructions="shared instructions here")
    assert raw.headers["x-kvgate-cache"] == "miss" and count(fake) == before + 3


def test_identical_requests_make_one_call(rgw: Gateway, fake: str) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return list(await asyncio.gather(*(client.post(
                rgw.v1 + "/responses", headers={"authorization": f"Bearer {rgw.api_key}"},
                json={"model": MODEL, "input": "twenty at once", "fake_fault": "slow:0.5"}) for _ in range(20))))

    before = count(fake)
    replies = asyncio.run(burst())
    assert count(fake) == before + 1
    assert {r.json()["output"][0]["content"][0]["text"] for r in replies} == {"echo: twenty at once"}
