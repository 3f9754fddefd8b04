"""Embeddings cached per input (a batch answered part from the cache, part from the upstream) and
legacy completions cached exactly, through the openai SDK; tenants kept apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
from openai import OpenAI

from tests.api.conftest import count, entries, last_request, wait_stored
from tests.conftest import Gateway, new_key
from tests.persistence.test_request_log import wait_for_rows


def sdk(gateway: Gateway, key: str | None = None) -> OpenAI:
    return OpenAI(base_url=gateway.v1, api_key=key or gateway.api_key, max_retries=0)


def test_embedding_batch_part_from_cache(gw: Gateway, fake_upstream: str) -> None:
    client = sdk(gw)
    before, stored = count(fake_upstream), entries(gw)
    raw = client.embeddings.with_raw_response.create(model="fake-embed", input=["alpha one", "beta two"],
                                                     encoding_format="float")
    first = raw.parse()
    assert raw.headers["x-kvgate-cache"] == "miss" and count(fake_upstream) == before + 1
    wait_stored(gw, stored + 2)

    raw = client.embeddings.with_raw_response.create(model="fake-embed", input=["alpha one", "gamma three",
                                                                                "beta two"], encoding_format="float")
    mixed = raw.parse()
    assert raw.headers["x-kvgate-cache"] == "hit-partial"
    assert last_request(fake_upstream)["body"]["input"] == ["gamma three"], "only the new input goes upstream"
    assert [d.index for d in mixed.data] == [0, 1, 2]
    assert mixed.data[0].embedding == first.data[0].embedding and mixed.data[2].embedding == first.data[1].embedding
    assert mixed.data[1].embedding != first.data[0].embedding
    assert mixed.model_extra["kvgate"] == {"cached_inputs": 2, "inputs": 3}
    assert mixed.usage.prompt_tokens == 2, "usage counts only what the upstream embedded"
    wait_stored(gw, stored + 3)

    calls = count(fake_upstream)
    raw = client.embeddings.with_raw_response.create(model="fake-embed", input="gamma three",
                                                     encoding_format="float")
    assert raw.headers["x-kvgate-cache"] == "hit-exact" and count(fake_upstream) == calls
    assert raw.parse().data[0].embedding == mixed.data[1].embedding and raw.parse().usage.prompt_tokens == 0

    other = sdk(gw, new_key(gw.database_url, "team-embed-other"))
    raw = other.embeddings.with_raw_response.create(model="fake-embed", input="gamma three", encoding_format="float")
    assert raw.headers["x-kvgate-cache"] == "miss" and count(fake_upstream) == calls + 1
    raw = client.embeddings.with_raw_response.create(model="fake-embed", input="gamma three",
                                                     encoding_format="float", dimensions=4)
    assert raw.headers["x-kvgate-cache"] == "miss", "dimensions are part of the key"


def test_embedding_requests_logged_with_their_cache_status(gw: Gateway, repo_root: Path) -> None:
    """Misses are logged as misses (they were logged with no status, so `kvgate stats` and the
    dashboard counted only the hits as lookups: 100% hits when half were misses; issue 44, item 6)."""
    client = sdk(gw, new_key(gw.database_url, "team-embed-log"))
    statuses: dict[str, str] = {}
    for inputs in (["log one"], ["log two"], ["log one"], ["log two"], ["log one", "log three"]):
        stored = entries(gw)
        raw = client.embeddings.with_raw_response.create(model="fake-embed", input=inputs, encoding_format="float")
        statuses[raw.headers["x-request-id"]] = raw.headers["x-kvgate-cache"]
        if raw.headers["x-kvgate-cache"] != "hit-exact":
            wait_stored(gw, stored + 1)
    assert list(statuses.values()) == ["miss", "miss", "hit-exact", "hit-exact", "hit-partial"]
    rows = wait_for_rows(gw.database_url, set(statuses))
    assert {request_id: row.cache for request_id, row in rows.items()} == statuses
    assert {row.route for row in rows.values()} == {"embeddings"}

    stats = subprocess.run([sys.executable, "-m", "gateway", "stats", "--json", "--database-url", gw.database_url],
                           cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert stats.returncode == 0, stats.stderr
    tenant = next(t for t in orjson.loads(stats.stdout)["tenants"] if t["tenant"] == "team-embed-log")
    assert tenant["requests"] == 5
    assert tenant["exact_hit_rate"] == 0.5, "two exact hits of four lookups (a partial hit counts as neither)"


def test_completions_cached_exactly(gw: Gateway, fake_upstream: str) -> None:
    client = sdk(gw)
    before, stored = count(fake_upstream), entries(gw)
    raw = client.completions.with_raw_response.create(model="fake-model", prompt="complete this legacy prompt")
    first = raw.parse()
    assert raw.headers["x-kvgate-cache"] == "miss" and first.choices[0].text == " echo: complete this legacy prompt"
    wait_stored(gw, stored + 1)
    raw = client.completions.with_raw_response.create(model="fake-model", prompt="complete this legacy prompt")
    assert raw.headers["x-kvgate-cache"] == "hit-exact"
    hit = raw.parse()
    assert hit.choices[0].text == first.choices[0].text
    assert hit.usage.prompt_tokens_details.cached_tokens == hit.usage.prompt_tokens == first.usage.prompt_tokens
    chunks = list(client.completions.create(model="fake-model", prompt="complete this legacy prompt", stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == first.usage.prompt_tokens
    assert count(fake_upstream) == before + 1

    # A streamed miss is assembled and stored too.
    stored = entries(gw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="fake-model", prompt="a streamed legacy prompt", stream=True) if c.choices)
    wait_stored(gw, stored + 1)
    raw = client.completions.with_raw_response.create(model="fake-model", prompt="a streamed legacy prompt")
    assert raw.headers["x-kvgate-cache"] == "hit-exact" and raw.parse().choices[0].text == streamed
