"""The cache vocabulary on every route: force-refresh, read-only, write-only, off, per-request TTL
and namespace; cache ids and keys, deleted through the admin API; provider prompt-cache fields."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI

from gateway.canonical.prompt_cache import derived_key, without_prompt_cache_fields
from gateway.responsecache.settings import ResponseCacheSettings
from gateway.settings import UpstreamSettings
from gateway.upstream.http import HttpBackend
from tests.api.conftest import ADMIN, count, entries, last_request, wait_stored
from tests.conftest import Gateway, start_gateway


def chat(gw: Gateway, content: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    auth = {"authorization": f"Bearer {gw.api_key}", **(headers or {})}
    reply = httpx.post(gw.v1 + "/chat/completions", headers=auth,
                       json={"model": "fake-model", "messages": [{"role": "user", "content": content}], **body})
    assert reply.status_code == 200, reply.text
    return reply


def stored_after(gw: Gateway, content: str, headers: dict[str, str] | None = None) -> httpx.Response:
    before = entries(gw)
    reply = chat(gw, content, headers)
    wait_stored(gw, before + 1)
    return reply


def test_refresh_reads_nothing_and_stores_the_new_answer(gw: Gateway, fake_upstream: str) -> None:
    first = stored_after(gw, "refresh me please")
    before = count(fake_upstream)
    refreshed = stored_after(gw, "refresh me please", {"x-kvgate-cache-mode": "refresh"})
    assert refreshed.headers["x-kvgate-cache"] == "bypass" and count(fake_upstream) == before + 1
    hit = chat(gw, "refresh me please")
    assert hit.headers["x-kvgate-cache"] == "hit-exact"
    assert hit.headers["x-kvgate-cache-key"] == first.headers["x-kvgate-cache-key"]
    # write-only is the same thing under the name some gateways use.
    again = stored_after(gw, "refresh me please", {"x-kvgate-cache-mode": "write-only"})
    assert again.headers["x-kvgate-cache"] == "bypass"
    assert int(chat(gw, "refresh me please").headers["x-kvgate-cache-id"]) > int(hit.headers["x-kvgate-cache-id"])


def test_read_only_and_off_store_nothing(gw: Gateway) -> None:
    read_only = chat(gw, "read only question here", {"x-kvgate-cache-mode": "read-only"})
    off = chat(gw, "read only question here", {"x-kvgate-cache-mode": "off"})
    assert (read_only.headers["x-kvgate-cache"], off.headers["x-kvgate-cache"]) == ("miss", "bypass")
    normal = stored_after(gw, "read only question here")
    assert normal.headers["x-kvgate-cache"] == "miss", "neither read-only nor off stored an answer"
    assert chat(gw, "read only question here", {"x-kvgate-cache-mode": "read-only"}).headers["x-kvgate-cache"] \
        == "hit-exact"
    assert chat(gw, "read only question here", {"x-kvgate-cache-mode": "off"}).headers["x-kvgate-cache"] == "bypass"


def test_ttl_and_namespace_per_request_on_other_routes(gw: Gateway) -> None:
    client = anthropic.Anthropic(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)
    request: dict[str, Any] = {"model": "claude-fake", "max_tokens": 16,
                               "messages": [{"role": "user", "content": "short lived answer"}]}
    before = entries(gw)
    short = client.messages.with_raw_response.create(**request, extra_headers={"x-kvgate-cache-ttl": "1",
                                                                               "x-kvgate-cache-namespace": "ns-a"})
    wait_stored(gw, before + 1)
    raw = client.messages.with_raw_response.create(**request, extra_headers={"x-kvgate-cache-namespace": "ns-a"})
    assert raw.headers["x-kvgate-cache"] == "hit-exact"
    other_ns = client.messages.with_raw_response.create(**request, extra_headers={"x-kvgate-cache-namespace": "ns-b",
                                                                                  "cache-control": "no-store"})
    assert other_ns.headers["x-kvgate-cache"] == "miss"
    time.sleep(1.2)
    expired = client.messages.with_raw_response.create(**request, extra_headers={"x-kvgate-cache-namespace": "ns-a",
                                                                                 "cache-control": "no-store"})
    assert expired.headers["x-kvgate-cache"] == "miss"
    # Gone now rather than at the next expiry sweep, which would shift other tests' entry counts.
    httpx.post(gw.base_url + "/admin/response-cache/delete", headers=ADMIN,
               json={"key": short.headers["x-kvgate-cache-key"]})

    responses = OpenAI(base_url=gw.v1, api_key=gw.api_key, max_retries=0).responses
    before = entries(gw)
    responses.create(model="fake-model", input="namespaced responses", extra_body={"kvgate": {"cache": {
        "namespace": "ns-r"}}})
    wait_stored(gw, before + 1)
    hit = responses.with_raw_response.create(model="fake-model", input="namespaced responses",
                                             extra_body={"kvgate": {"cache": {"namespace": "ns-r"}}})
    assert hit.headers["x-kvgate-cache"] == "hit-exact"
    refresh = responses.with_raw_response.create(model="fake-model", input="namespaced responses",
                                                 extra_body={"kvgate": {"cache": {"namespace": "ns-r",
                                                                                  "mode": "refresh"}}})
    assert refresh.headers["x-kvgate-cache"] == "bypass"


def test_delete_by_id_and_by_key(gw: Gateway) -> None:
    stored_after(gw, "delete me by id")
    hit = chat(gw, "delete me by id")
    entry_id = hit.headers["x-kvgate-cache-id"]
    assert httpx.delete(f"{gw.base_url}/admin/response-cache/entries/{entry_id}",
                        headers={"authorization": f"Bearer {gw.api_key}"}).status_code == 403
    deleted = httpx.delete(f"{gw.base_url}/admin/response-cache/entries/{entry_id}", headers=ADMIN)
    assert deleted.json() == {"deleted": 1, "id": int(entry_id)}
    assert chat(gw, "delete me by id", {"cache-control": "no-store"}).headers["x-kvgate-cache"] == "miss"
    assert httpx.delete(f"{gw.base_url}/admin/response-cache/entries/{entry_id}", headers=ADMIN).status_code == 404

    key = stored_after(gw, "delete me by key").headers["x-kvgate-cache-key"]
    deleted = httpx.post(gw.base_url + "/admin/response-cache/delete", headers=ADMIN, json={"key": key})
    assert deleted.json()["deleted"] == 1
    assert chat(gw, "delete me by key", {"cache-control": "no-store"}).headers["x-kvgate-cache"] == "miss"
    bad = httpx.post(gw.base_url + "/admin/response-cache/delete", headers=ADMIN, json={"id": "x"})
    assert bad.status_code == 422


def test_never_read_entries_are_counted(gw: Gateway) -> None:
    def never_read() -> int:
        return int(httpx.get(gw.base_url + "/admin/response-cache/stats", headers=ADMIN).json()["entries_never_read"])

    before = never_read()
    stored_after(gw, "an answer nobody asks for again")
    assert never_read() == before + 1
    chat(gw, "an answer nobody asks for again")
    assert never_read() == before


def test_bad_mode_is_a_clear_error(gw: Gateway) -> None:
    reply = httpx.post(gw.v1 + "/chat/completions", headers={"authorization": f"Bearer {gw.api_key}",
                                                             "x-kvgate-cache-mode": "sometimes"},
                       json={"model": "fake-model", "messages": [{"role": "user", "content": "x"}]})
    assert reply.status_code == 422 and reply.json()["error"]["param"] == "x-kvgate-cache-mode"


def test_prompt_cache_key_is_forwarded_and_not_in_the_key(gw: Gateway, fake_upstream: str) -> None:
    stored_after(gw, "keyed for the provider", None)
    hit = chat(gw, "keyed for the provider", prompt_cache_key="app-key-1", cache_salt="s1")
    assert hit.headers["x-kvgate-cache"] == "miss", "cache_salt is part of the key"
    chat(gw, "keyed for the provider", {"cache-control": "no-cache"}, prompt_cache_key="app-key-2")
    assert last_request(fake_upstream)["body"]["prompt_cache_key"] == "app-key-2"
    assert chat(gw, "keyed for the provider", prompt_cache_key="app-key-3").headers["x-kvgate-cache"] == "hit-exact"


@pytest.fixture(scope="module")
def deriving_gateway(fake_upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('derive') / 'kvgate.db'}"
    gateways = start_gateway(fake_upstream, url, derive_prompt_cache_key=True,
                             responsecache=ResponseCacheSettings(semantic=False))
    yield next(gateways)
    gateways.close()


def test_prompt_cache_key_derived_from_the_session(deriving_gateway: Gateway, fake_upstream: str) -> None:
    chat(deriving_gateway, "a turn of session one", {"x-kvgate-session": "conv-1", "cache-control": "no-store"})
    assert last_request(fake_upstream)["body"]["prompt_cache_key"] == derived_key("team-a", "conv-1")
    chat(deriving_gateway, "own key wins", {"x-kvgate-session": "conv-1", "cache-control": "no-store"},
         prompt_cache_key="mine")
    assert last_request(fake_upstream)["body"]["prompt_cache_key"] == "mine"
    chat(deriving_gateway, "no session, no key", {"cache-control": "no-store"})
    assert "prompt_cache_key" not in last_request(fake_upstream)["body"]


def test_upstreams_that_reject_the_fields_do_not_get_them() -> None:
    body = {"model": "m", "prompt_cache_key": "k", "cache_salt": "s", "messages": []}
    assert without_prompt_cache_fields(body) == {"model": "m", "messages": []}
    strict = HttpBackend(UpstreamSettings(name="strict", base_url="http://127.0.0.1:1/v1", prompt_cache_fields=False))
    assert b"prompt_cache_key" not in strict._outgoing(body) and b"cache_salt" not in strict._outgoing(body)
    default = HttpBackend(UpstreamSettings(name="default", base_url="http://127.0.0.1:1/v1"))
    assert b"prompt_cache_key" in default._outgoing(body)
