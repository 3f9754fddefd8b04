"""Feedback on hits (`POST /v1/kvgate/feedback`, responsecache/semantic/feedback.py) through the real gateway
and the openai SDK, on SQLite and PostgreSQL: a wrong report ends the entry's semantic serving (its
exact serving stays), here, on another replica and after a restart."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ADMIN_SECRET, Gateway
from tests.observability.conftest import scrape, value
from tests.responsecache.conftest import ADMIN, Client, cache_gateway, database, other_tenant_key, upstream_count
from tests.responsecache.test_replicas import eventually

STORED = "feedback: how do I reset the password of my wifi router?"
PARAPHRASE = "feedback: how can I reset my wifi router password?"
NO_STORE = {"cache-control": "no-store"}


def report(client: Client, cache_id: Any, *, correct: bool) -> Any:
    """The openai SDK's own call for a route it has no method for."""
    return client.sdk.post("/kvgate/feedback", body={"cache_id": cache_id, "correct": correct}, cast_to=object)


def reported_entries(gateway: Gateway, **params: str) -> list[dict[str, Any]]:
    listing = httpx.get(gateway.base_url + "/admin/response-cache/entries", headers=ADMIN,
                        params={"reported": "wrong", **params})
    listing.raise_for_status()
    return list(listing.json()["data"])


def test_a_wrong_report_ends_semantic_serving_and_keeps_the_exact_key(gw: Gateway, fake_upstream: str) -> None:
    client = Client(gw)
    client.miss_then_stored(STORED)
    hit = client.chat(PARAPHRASE, headers=NO_STORE)
    assert hit.cache == "hit-semantic", hit.cache
    cache_id = hit.headers["x-kvgate-cache-id"]

    stranger = Client(gw, other_tenant_key(gw, "team-feedback-other"))
    with pytest.raises(openai.NotFoundError) as refused:
        report(stranger, cache_id, correct=False)
    assert refused.value.body["code"] == "not_found" and refused.value.body["param"] == "cache_id"
    assert client.chat(PARAPHRASE, headers=NO_STORE).cache == "hit-semantic", "another tenant's report counted"

    before = scrape(gw)
    answer = report(client, cache_id, correct=False)
    assert answer == {"object": "kvgate.feedback", "cache_id": cache_id, "verdict": "wrong"}
    calls = upstream_count(fake_upstream)
    again = client.chat(PARAPHRASE, headers=NO_STORE)
    assert again.cache == "miss" and upstream_count(fake_upstream) == calls + 1
    exact = client.chat(STORED)
    assert exact.cache == "hit-exact" and exact.headers["x-kvgate-cache-id"] == cache_id

    report(client, int(cache_id), correct=False)  # twice is fine: counted twice
    report(client, cache_id, correct=True)
    after = scrape(gw)
    assert value(after, "kvgate_cache_feedback_total", verdict="wrong") - \
        value(before, "kvgate_cache_feedback_total", verdict="wrong") == 2
    assert value(after, "kvgate_cache_feedback_total", verdict="correct") - \
        value(before, "kvgate_cache_feedback_total", verdict="correct") == 1

    [listed] = [e for e in reported_entries(gw, tenant="team-a") if e["id"] == int(cache_id)]
    assert listed["tenant"] == "team-a" and listed["question"] == STORED
    assert listed["wrong_reports"] == 2 and listed["correct_reports"] == 1 and listed["hits"] >= 2
    assert reported_entries(gw, tenant="team-feedback-other") == []
    summary = httpx.get(gw.base_url + "/dashboard/api/summary", headers=ADMIN).json()
    assert summary["response_cache"]["feedback"]["wrong"] >= 2
    assert summary["response_cache"]["feedback"]["entries_reported_wrong"] >= 1


def test_lookups_near_a_reported_entry_need_a_higher_judge_probability(gw: Gateway) -> None:
    """A paraphrase served at a judge probability under 0.92 (the deployment's English threshold is
    0.82) is refused once another question on its topic is reported wrong: near a reported entry a
    hit needs 0.92. A paraphrase on another topic is served as before."""
    client = Client(gw)
    space = {"x-kvgate-cache-namespace": "neighbourhood"}
    asked = "how can I reset my wifi router password?"
    stored = "how do I reset the password of my wifi router?"
    reported = "how do I update the firmware of my wifi router?"  # embeds at 0.91 from `asked`
    elsewhere = ("how can I replace my car key fob battery?", "how do I replace the battery of my car key fob?")
    for question in (stored, reported, elsewhere[1]):
        client.miss_then_stored(question, headers=space)
    before = client.chat(asked, headers={**space, **NO_STORE})
    assert before.cache == "hit-semantic" and float(before.headers["x-kvgate-judge-probability"]) < 0.82 + 0.1
    report(client, client.chat(reported, headers=space).headers["x-kvgate-cache-id"], correct=False)
    near = httpx.get(gw.base_url + "/admin/response-cache/stats", headers=ADMIN).json()["semantic_near_reported"]
    assert client.chat(asked, headers={**space, **NO_STORE}).cache == "miss"
    assert httpx.get(gw.base_url + "/admin/response-cache/stats", headers=ADMIN).json()["semantic_near_reported"] \
        == near + 1
    assert client.chat(stored, headers=space).cache == "hit-exact"
    assert client.chat(elsewhere[0], headers={**space, **NO_STORE}).cache == "hit-semantic"


def test_a_correct_report_changes_nothing(gw: Gateway) -> None:
    client = Client(gw)
    client.miss_then_stored("feedback: what is the boiling point of water at sea level?")
    hit = client.chat("feedback: at sea level, what is the boiling point of water?", headers=NO_STORE)
    assert hit.cache == "hit-semantic", hit.cache
    assert report(client, hit.headers["x-kvgate-cache-id"], correct=True)["verdict"] == "correct"
    assert client.chat("feedback: at sea level, what is the boiling point of water?").cache == "hit-semantic"


@pytest.mark.parametrize("body, status, param", [
    ({"cache_id": "abc", "correct": False}, 422, "cache_id"),
    ({"cache_id": 0, "correct": False}, 422, "cache_id"),
    ({"cache_id": 2**63, "correct": False}, 422, "cache_id"),
    ({"cache_id": True, "correct": False}, 422, "cache_id"),
    ({"cache_id": 1}, 422, "correct"),
    ({"cache_id": 1, "correct": "no"}, 422, "correct"),
    ({"cache_id": 987654321, "correct": False}, 404, "cache_id"),
])
def test_bad_or_unknown_reports_are_openai_errors(gw: Gateway, body: dict[str, Any], status: int,
                                                  param: str) -> None:
    reply = httpx.post(gw.v1 + "/kvgate/feedback", json=body, headers={"authorization": f"Bearer {gw.api_key}"})
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_feedback_needs_a_tenant_key_and_a_json_object(gw: Gateway) -> None:
    assert httpx.post(gw.v1 + "/kvgate/feedback", json={"cache_id": 1, "correct": False}).status_code == 401
    garbled = httpx.post(gw.v1 + "/kvgate/feedback", content=b"{not json",
                         headers={"authorization": f"Bearer {gw.api_key}"})
    assert garbled.status_code == 400 and garbled.json()["error"]["code"] == "invalid_json"
    listing = httpx.get(gw.base_url + "/admin/response-cache/entries", params={"reported": "wrong"},
                        headers={"authorization": f"Bearer {gw.api_key}"})
    assert listing.status_code == 403
    unknown = httpx.get(gw.base_url + "/admin/response-cache/entries", params={"reported": "right"},
                        headers={"authorization": f"Bearer {ADMIN_SECRET}"})
    assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "query.reported"
    nul = httpx.get(gw.base_url + "/admin/response-cache/entries", params={"reported": "wrong", "tenant": "a\x00b"},
                    headers={"authorization": f"Bearer {ADMIN_SECRET}"})
    assert nul.status_code == 422, "PostgreSQL refuses a NUL in text: it must not reach the driver"


def test_a_report_reaches_the_other_replica_and_outlives_a_restart(fake_upstream: str, embedding_model: Any,
                                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    with database("postgres", tmp_path_factory) as url:
        with cache_gateway(fake_upstream, url, poll_interval_s=0.2) as a, \
                cache_gateway(fake_upstream, url, poll_interval_s=0.2) as b:
            on_a, on_b = Client(a), Client(b)
            on_a.miss_then_stored(STORED)
            on_b.wait_entries(1, timeout_s=3.0)
            hit = on_b.chat(PARAPHRASE, headers=NO_STORE)
            assert hit.cache == "hit-semantic"  # B holds the entry's embedding and answer in memory
            report(on_a, hit.headers["x-kvgate-cache-id"], correct=False)
            eventually(lambda: on_b.chat(PARAPHRASE, headers=NO_STORE).cache == "miss", timeout_s=2.0)
            assert on_b.chat(STORED).cache == "hit-exact"
        with cache_gateway(fake_upstream, url) as restarted:
            client = Client(restarted)
            assert client.chat(PARAPHRASE, headers=NO_STORE).cache == "miss"
            assert client.chat(STORED).cache == "hit-exact"
