"""The staged semantic lookup through the real gateway: a miss no stored question could answer is
ended by the cheap stage (nothing embedded); a stored question is embedded only when a lookup first
needs it, and that embedding reaches SQL; a paraphrase is still served; past its CPU budget the
semantic cache forwards instead of embedding."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import sqlalchemy as sa

from gateway.responsecache.semantic.embedder import BURST_S, SATURATED, CpuBudget, Embedder
from tests.conftest import Gateway
from tests.observability.conftest import scrape, value
from tests.responsecache.conftest import ADMIN, Client, cache_gateway


def stats(gw: Gateway) -> dict:
    reply = httpx.get(gw.base_url + "/admin/response-cache/stats", headers=ADMIN)
    reply.raise_for_status()
    return reply.json()


def stored_embedding(gw: Gateway, query: str) -> bytes | None:
    """The stored embedding of an entry, read from the SQLite file."""
    engine = sa.create_engine(gw.database_url.replace("+aiosqlite", ""))
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text("select embedding from response_cache where query = :q"), {"q": query}).scalar()
    finally:
        engine.dispose()


def test_unrelated_miss_is_ruled_out_without_an_embedding(gw: Gateway) -> None:
    client = Client(gw)
    client.miss_then_stored("What is the best way to learn to play the violin as an adult?")
    before = stats(gw)
    miss = client.chat("How many moons does the planet Jupiter have?")
    assert miss.cache == "miss"
    assert miss.headers.get("x-kvgate-semantic-stage") == "ruled-out"
    after = stats(gw)
    assert after["semantic_ruled_out"] == before["semantic_ruled_out"] + 1
    assert after["semantic_judged"] == before["semantic_judged"]
    assert after["embedded_entries"] == before["embedded_entries"], "nothing was embedded for a ruled-out miss"


def test_stored_question_is_embedded_when_first_needed(gw: Gateway) -> None:
    client = Client(gw)
    question = "How do I clean the filter of my dishwasher at home?"
    client.miss_then_stored(question)
    client.wait_entries(1)
    first = stats(gw)
    hit = client.chat("How can I clean my dishwasher filter at home?")
    assert hit.cache == "hit-semantic", hit.headers
    after = stats(gw)
    assert after["semantic_judged"] == first["semantic_judged"] + 1
    assert after["embedded_entries"] >= first["embedded_entries"] + 1
    if gw.database_url.startswith("sqlite"):
        deadline = time.monotonic() + 10
        while stored_embedding(gw, question) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stored_embedding(gw, question) is not None, "the embedding computed on demand reaches SQL"


def test_a_hit_is_judged_with_its_whole_sketch_neighbourhood_embedded(gw: Gateway) -> None:
    """Before a hit is served, the question's nearest stored questions by sketch are embedded too,
    those far below the cheap stage's floor included: the judge reads how crowded the neighbourhood
    is, and was calibrated with every stored question embedded."""
    client = Client(gw)
    system = {"role": "system", "content": "Answer household questions in one line (neighbourhood test)."}
    stored = ["How do I descale my electric kettle at home?", "What is the capital city of Australia?",
              "Why do cats purr when they are happy?", "How tall is Mount Everest in meters?"]
    for question in stored:
        client.miss_then_stored(messages=[system, {"role": "user", "content": question}])
    before = stats(gw)["embedded_entries"]
    hit = client.chat(messages=[system, {"role": "user", "content": "How can I descale an electric kettle at home?"}])
    assert hit.cache == "hit-semantic", hit.headers
    assert stats(gw)["embedded_entries"] == before + len(stored), "the whole neighbourhood, not only the candidate"


def test_spent_cpu_budget_forwards_plausible_lookups_without_embedding(
        fake_upstream: str, tmp_path_factory: pytest.TempPathFactory, embedding_model: object) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('budget') / 'kvgate.db'}"
    # A bucket of 0.02 s: the cheap stages fit, the first judged lookup (two embeddings) overdraws it.
    with cache_gateway(fake_upstream, url, semantic_cpu_share=0.01) as gw:
        client = Client(gw)
        client.miss_then_stored("How do I replace the battery of my car key fob?")
        first = client.chat("How can I replace my car key fob battery?")
        assert first.cache == "hit-semantic"  # the first lookup finds the budget not yet spent
        second = client.chat("How do I change the battery in my car key fob?")
        assert second.cache == "miss" and second.headers.get("x-kvgate-semantic-skipped") == "busy"
        ruled_out = stats(gw)["semantic_ruled_out"]
        other = client.chat("What is the tallest mountain in Africa?")
        assert other.headers.get("x-kvgate-semantic-skipped") == "busy", "a spent budget skips the cheap stage too"
        assert "x-kvgate-semantic-stage" not in other.headers
        assert stats(gw)["semantic_busy"] == 2 and stats(gw)["semantic_ruled_out"] == ruled_out
        sampled = client.chat("How can I replace my car key fob battery?", temperature=0.5)
        assert sampled.headers.get("x-kvgate-semantic-skipped") == "sampling"
        metrics = scrape(gw)
        assert value(metrics, "kvgate_response_cache_semantic_skipped_total", reason="busy") == 2
        assert value(metrics, "kvgate_response_cache_semantic_skipped_total", reason="sampling") == 1


def test_cpu_budget_refills_at_its_share() -> None:
    budget = CpuBudget(share=0.5)  # a bucket of 0.5 * BURST_S seconds
    assert budget.available()
    budget.spend(0.5 * BURST_S + 0.5)  # overdrawn by 0.5 s
    assert not budget.available()
    budget._stamp -= 2.0  # two seconds later (an idle loop): 1.0 s refilled at half a core
    assert budget.available()
    assert CpuBudget(share=0).available(), "share 0 is no limit"


def test_cpu_budget_keeps_what_is_left_for_likely_hits() -> None:
    budget = CpuBudget(share=0.5)
    full = 0.5 * BURST_S
    assert budget.available(chance=0.02), "a full bucket embeds every plausible lookup"
    budget.spend(full / 2)  # half left
    assert not budget.available(chance=0.02), "an unlikely hit may not draw on a half-spent bucket"
    assert budget.available(chance=0.6), "a likely one may"
    budget.spend(full / 2 - full / 40)  # a fortieth left
    assert budget.available(chance=1.0) and not budget.available(chance=0.9)


def test_cpu_budget_refills_only_from_what_the_loop_leaves_idle() -> None:
    budget = CpuBudget(share=1.0)
    budget.spend(budget.share * BURST_S + 0.3)  # overdrawn by 0.3 s
    started = time.monotonic()
    while time.monotonic() - started < 0.5:  # the calling thread (the loop) busy for 0.5 s
        sum(range(1000))
    assert not budget.available(), "a loop busy all along refills (next to) nothing"
    assert budget.loop_busy > 0.5
    time.sleep(0.5)  # the loop idle for 0.5 s: 0.5 s of a full core's share
    assert budget.available()
    assert budget.loop_busy < 0.5


async def test_queued_texts_are_charged_before_their_batch_runs(embedding_model: object) -> None:
    """Lookups that arrive while a batch runs must see the budget it will spend: charging only once
    a batch was timed let 32 concurrent clients drive the embeddings far past their share."""
    embedder = Embedder(embedding_model, cpu_share=0.01)  # a bucket of 0.08 s
    embedder.seconds_per_text = 0.05
    both = asyncio.gather(embedder.embed("How do I reset my router?"), embedder.embed("Why is the sky blue?"))
    await asyncio.sleep(0)  # both queued, the batch not yet timed
    assert not embedder.budget.available(), "two texts at 0.05 s each overdraw a 0.08 s bucket at once"
    vectors = await both
    assert all(v.shape == (384,) for v in vectors)
    assert embedder.seconds_per_text != 0.05, "the charge per text follows what batches measure"
    embedder.close()


def test_cpu_budget_spends_nothing_while_the_loop_is_saturated() -> None:
    budget = CpuBudget(share=0.5)
    assert budget.available(), "a full bucket and an idle loop"
    # The last second: the loop (the calling thread) ran 0.99 s of it.
    budget._stamp, budget._loop_cpu = time.monotonic() - 1.0, time.thread_time() - 0.99
    assert not budget.available(chance=1.0), "a saturated loop spends not even a full bucket"
    assert budget.loop_busy >= SATURATED
    budget._stamp, budget._loop_cpu = time.monotonic() - 1.0, time.thread_time() - 0.5  # half idle since
    assert budget.available(chance=1.0)
