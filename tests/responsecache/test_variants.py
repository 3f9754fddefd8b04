"""Trivial variants (responsecache/semantic/variants.py) through the real gateway and the openai SDK, on
SQLite and PostgreSQL: a question that differs from a stored one only in case, spacing, width forms
or punctuation is a semantic hit in its own partition, never in another, and never when the
normalized texts differ; it is served even when the semantic stage is starved."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from gateway.responsecache.semantic.variants import LONG_FORM, QUESTION_CHARS, normalized_question
from tests.conftest import Gateway
from tests.responsecache.conftest import ADMIN, Client, cache_gateway, other_tenant_key, upstream_count

README_QUESTION = "What is the capital of France?"
NO_STORE = {"cache-control": "no-store"}


def variant_hit(reply: Any) -> bool:
    return reply.cache == "hit-semantic" and reply.headers.get("x-kvgate-semantic-stage") == "variant"


@pytest.mark.parametrize("text, form", [
    ("What is the capital of France?", "what is the capital of france"),
    ("  what   is the capital\tof France ?! ", "what is the capital of france"),
    ("\uff37\uff48\uff41\uff54\u3000\uff49\uff53 the capital of France\uff1f", "what is the capital of france"),
    ("怎么修改微信密码？", "怎么修改微信密码"),
    ("怎么修改微信密码\uff61", "怎么修改微信密码"),
    # Only width forms are folded: NFKC would make these "what is 106" and "x2".
    ("What is 10\u2076?", "what is 10\u2076"),
    ("Solve x\u00b2 = 4.", "solve x\u00b2=4"),
    ("Is C++ faster than C?", "is c++faster than c"),
    # Punctuation anywhere reads as a word break, whitespace counts only between two Latin words.
    ("北京，今天天气怎么样？", "北京今天天气怎么样"),
    ("北京 今天 天气 怎么样 ?", "北京今天天气怎么样"),
    ("《红楼梦》的作者是谁？", "红楼梦的作者是谁"),
    ("用 Python 写爬虫", "用python写爬虫"),
    ("Hello , what's the time ?", "hello whats the time"),
    ("Is it notable?", "is it notable"),
    ("Is it not able?", "is it not able"),
    # ... but kept where it makes another number, and symbols are kept.
    ("Is 3.5 bigger than 35?", "is 3.5 bigger than 35"),
    ("What is -5 squared?", "what is-5 squared"),
    ("What is 5 - 3?", "what is 5-3"),
    ("Is 1,000 more than 999?", "is 1,000 more than 999"),
    ("Is C# like C?", "is c#like c"),
    ("Is 5% a lot?", "is 5%a lot"),
])
def test_normalized_question(text: str, form: str) -> None:
    assert normalized_question(text) == form


def test_a_long_turn_folds_only_case_width_and_whitespace() -> None:
    code = "Why does this fail? " + "x = f(a, b)\n" * 60
    assert normalized_question(code).startswith(LONG_FORM)
    assert normalized_question(code) != normalized_question(code.replace(", ", " "))
    assert normalized_question(code) == normalized_question(code.upper().replace("\n", "  \n"))
    assert normalized_question("x" * QUESTION_CHARS) != LONG_FORM + "x" * QUESTION_CHARS


def test_the_readme_question_in_lower_case_without_its_question_mark_is_a_hit(gw: Gateway,
                                                                            fake_upstream: str) -> None:
    client = Client(gw)
    first = client.miss_then_stored(README_QUESTION)
    calls = upstream_count(fake_upstream)
    hit = client.chat("what is the capital of france")
    assert variant_hit(hit), hit.headers
    assert hit.content == first.content and hit.similarity == 1.0
    assert hit.headers["x-kvgate-cache-id"] and "x-kvgate-judge-probability" not in hit.headers
    assert hit.body.model_extra["kvgate"]["cache"] == "semantic"
    assert hit.body.usage.prompt_tokens_details.cached_tokens == hit.body.usage.prompt_tokens
    streamed = client.chat("what is the capital of france", stream=True)
    assert variant_hit(streamed) and streamed.content == first.content
    assert upstream_count(fake_upstream) == calls, "variants never reach the upstream"


@pytest.mark.parametrize("variant", [
    "WHAT IS THE TALLEST MOUNTAIN IN AFRICA",
    "  What is   the tallest\tmountain in Africa ?  ",
    "\uff37\uff48\uff41\uff54\u3000\uff49\uff53\u3000\uff54\uff48\uff45\u3000\uff54\uff41\uff4c\uff4c\uff45\uff53\uff54"
    "\u3000mountain in Africa\uff1f",
    "What is the tallest mountain in Africa!",
    "What is the tallest mountain in Africa...",
])
def test_case_spacing_width_and_end_punctuation_variants_hit(gw: Gateway, variant: str) -> None:
    client = Client(gw)
    stored = "What is the tallest mountain in Africa?"
    if client.chat(stored, headers=NO_STORE).cache == "miss":  # the first parameter stores it
        client.miss_then_stored(stored)
    hit = client.chat(variant, headers=NO_STORE)
    assert variant_hit(hit), (variant, hit.headers)


def test_full_width_chinese_punctuation_variant_hits(gw: Gateway) -> None:
    client = Client(gw)
    client.miss_then_stored("怎么修改支付宝的登录密码？")
    assert variant_hit(client.chat("怎么修改支付宝的登录密码"))
    assert variant_hit(client.chat("怎么修改支付宝的登录密码?"))


def test_a_chinese_question_with_an_inner_comma_or_spaces_hits_without_the_judge(gw: Gateway) -> None:
    client = Client(gw)
    client.miss_then_stored("北京今天天气怎么样？")
    for variant in ("北京，今天天气怎么样？", "北京 今天 天气怎么样", " 北京，今天天气怎么样 ! "):
        hit = client.chat(variant, headers=NO_STORE)
        assert variant_hit(hit) and "x-kvgate-judge-probability" not in hit.headers, (variant, hit.headers)


def test_other_tenants_contexts_and_namespaces_never_get_a_variant(gw: Gateway) -> None:
    client = Client(gw)
    system = {"role": "system", "content": "You are a geography tutor (variant partitions)."}
    question = "Which river flows through Vienna?"
    client.miss_then_stored(messages=[system, {"role": "user", "content": question}])
    lowered = {"role": "user", "content": "which river flows through vienna"}
    assert variant_hit(client.chat(messages=[system, lowered], headers=NO_STORE))

    other = Client(gw, other_tenant_key(gw, "team-variants-other"))
    assert other.chat(messages=[system, lowered], headers=NO_STORE).cache == "miss"
    contexts = {
        "no system prompt": [lowered],
        "another system prompt": [{"role": "system", "content": "You are a pirate."}, lowered],
        "history": [system, {"role": "user", "content": "I am planning a trip."},
                    {"role": "assistant", "content": "Noted."}, lowered],
    }
    for name, messages in contexts.items():
        reply = client.chat(messages=messages, headers=NO_STORE)
        assert reply.cache == "miss", name
    namespaced = client.chat(messages=[system, lowered], headers={**NO_STORE, "x-kvgate-cache-namespace": "elsewhere"})
    assert namespaced.cache == "miss"


@pytest.mark.parametrize("stored, asked", [
    ("What was the population of Tokyo in 1990?", "what was the population of tokyo in 1991"),
    ("How many legs does a spider have?", "how many legs does a spider have not"),
    ("Is 7 a prime number?", "is 17 a prime number"),
])
def test_different_normalized_texts_are_not_variants(gw: Gateway, stored: str, asked: str) -> None:
    client = Client(gw)
    client.miss_then_stored(stored)
    reply = client.chat(asked, headers=NO_STORE)
    assert reply.cache == "miss", reply.headers
    assert reply.headers.get("x-kvgate-semantic-stage") != "variant"


def test_controls_sampling_expiry_and_reports_are_respected(gw: Gateway) -> None:
    client = Client(gw)
    stored = "Who wrote the novel War and Peace?"
    variant = "who wrote the novel war and peace"
    first = client.miss_then_stored(stored)
    assert client.chat(variant, headers={**NO_STORE, "x-kvgate-semantic": "off"}).cache == "miss"
    sampled = client.chat(variant, temperature=0.9, headers=NO_STORE)
    assert sampled.cache == "miss" and sampled.headers["x-kvgate-semantic-skipped"] == "sampling"
    assert client.chat(variant, headers={"cache-control": "no-cache, no-store"}).cache == "bypass"
    # A variant is the same question: any bar a request sets (a probability <= 1) holds for it.
    strict = client.chat(variant, headers={**NO_STORE, "x-kvgate-semantic-threshold": "1.0"})
    assert variant_hit(strict) and strict.content == first.content

    hit = client.chat(variant, headers=NO_STORE)
    assert variant_hit(hit)
    reported = client.sdk.post("/kvgate/feedback", body={"cache_id": hit.headers["x-kvgate-cache-id"],
                                                         "correct": False}, cast_to=object)
    assert reported["verdict"] == "wrong"
    assert client.chat(variant, headers=NO_STORE).cache == "miss", "an entry reported wrong serves no variant"
    assert client.chat(stored).cache == "hit-exact", "its exact key still answers"

    client.miss_then_stored("Who painted The Starry Night?", headers={"x-kvgate-cache-ttl": "2"})
    assert variant_hit(client.chat("who painted the starry night", headers=NO_STORE))
    time.sleep(2.1)
    assert client.chat("who painted the starry night", headers=NO_STORE).cache == "miss", "expired"


def test_a_judged_miss_reports_the_nearest_similarity(gw: Gateway) -> None:
    client = Client(gw)
    space = {"x-kvgate-cache-namespace": "nearest"}
    client.miss_then_stored("How do I reset the password of my wifi router?", headers=space)
    # A bar no judge probability reaches: the paraphrase is judged, turned down, and says how close it was.
    miss = client.chat("How can I reset my wifi router password?",
                       headers={**space, **NO_STORE, "x-kvgate-semantic-threshold": "1.0"})
    assert miss.cache == "miss" and miss.headers["x-kvgate-semantic-stage"] == "judged"
    assert 0.8 < float(miss.headers["x-kvgate-similarity"]) <= 1
    unrelated = client.chat("Why do cats purr when they are happy?", headers={**space, **NO_STORE})
    assert unrelated.cache == "miss" and unrelated.headers["x-kvgate-semantic-ruled-out"] == "below-floor"
    assert 0 <= float(unrelated.headers["x-kvgate-similarity"]) < 0.7, "the nearest one's sketch cosine"


def test_variants_are_served_while_the_semantic_stage_is_starved(
        fake_upstream: str, tmp_path_factory: pytest.TempPathFactory, embedding_model: object) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('variants-busy') / 'kvgate.db'}"
    # A bucket of 0.02 s: the first judged lookup (two embeddings) overdraws it for seconds.
    with cache_gateway(fake_upstream, url, semantic_cpu_share=0.01) as gw:
        client = Client(gw)
        client.miss_then_stored("How do I replace the battery of my car key fob?")
        client.chat("How can I replace my car key fob battery?", headers=NO_STORE)  # judged: spends the budget
        busy = client.chat("How do I change the battery in my car key fob?", headers=NO_STORE)
        assert busy.cache == "miss" and busy.headers.get("x-kvgate-semantic-skipped") == "busy"
        variant = client.chat("how do i replace the battery of my car key fob", headers=NO_STORE)
        assert variant_hit(variant) and "x-kvgate-semantic-skipped" not in variant.headers
        stats = httpx.get(gw.base_url + "/admin/response-cache/stats", headers=ADMIN).json()
        assert stats["semantic_variants"] == 1 and stats["semantic_busy"] >= 1
