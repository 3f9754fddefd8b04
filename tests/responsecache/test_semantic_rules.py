"""Who may get a semantic hit, through the real gateway: long shared contexts are judged by what
differs, Chinese turns are looked up (and their near misses refused), languages the verifier was not
validated on get the exact cache only, and a request with no temperature (the openai SDK's default)
may get a paraphrase's answer."""

from __future__ import annotations

from tests.conftest import Gateway
from tests.responsecache.conftest import Client

# 60 short sentences, about 300 words: past the ~256 word pieces the old embedder read, under the
# default `max_query_chars`, so the turn is looked up.
CONTEXT = " ".join(f"Note {i}: the old lighthouse keeper wrote this." for i in range(60))


def test_long_shared_context_is_judged_by_the_question_that_differs(gw: Gateway) -> None:
    """60 sentences of context, then two different questions: before, they embedded at 0.996 and
    the first answer was served to the second (issue 13, item 1)."""
    client = Client(gw)
    client.miss_then_stored(CONTEXT + " What is the capital of France?")
    other = client.chat(CONTEXT + " How many legs does a spider have?")
    assert other.headers.get("x-kvgate-semantic-skipped") is None, "it must be looked up, not skipped"
    assert other.cache == "miss", other.similarity
    assert client.chat(CONTEXT + " What is the capital of France?").cache == "hit-exact"


def test_long_shared_context_still_serves_a_paraphrase(gw: Gateway) -> None:
    client = Client(gw)
    client.miss_then_stored(CONTEXT + " How do I reset the password of my wifi router?")
    assert client.chat(CONTEXT + " How can I reset my wifi router password?").cache == "hit-semantic"


def test_chinese_turns_are_looked_up(gw: Gateway) -> None:
    """A Chinese sentence has no spaces: it used to count as one word, a trivial turn never looked up."""
    client = Client(gw)
    client.miss_then_stored("怎么修改微信密码？")
    paraphrase = client.chat("微信密码怎么修改？")
    assert paraphrase.headers.get("x-kvgate-semantic-skipped") is None
    assert paraphrase.cache == "hit-semantic"
    for near_miss in ("怎么修改支付宝密码？", "为什么不能修改微信密码？"):
        assert client.chat(near_miss).cache == "miss", near_miss
    short = client.chat("好的")
    assert short.cache == "miss" and short.headers.get("x-kvgate-semantic-skipped") == "trivial"


def test_unvalidated_language_gets_the_exact_cache_only(gw: Gateway) -> None:
    client = Client(gw)
    client.miss_then_stored("Comment réinitialiser le mot de passe de mon routeur wifi ?")
    again = client.chat("Comment réinitialiser le mot de passe de mon routeur wifi ?")
    assert again.cache == "hit-exact"
    reworded = client.chat("Comment puis-je réinitialiser le mot de passe du routeur wifi ?")
    assert reworded.cache == "miss"
    assert reworded.headers.get("x-kvgate-semantic-skipped") == "language-not-validated"


def test_no_temperature_may_get_a_paraphrase_and_sampling_may_not(gw: Gateway) -> None:
    client = Client(gw)
    client.miss_then_stored("sdk default: How do I reset the password of my wifi router?", temperature=None)
    unset = client.chat("sdk default: How can I reset my wifi router password?", temperature=None)
    assert unset.cache == "hit-semantic"
    sampled = client.chat("sdk default: How can I reset my wifi router password?", temperature=0.8)
    assert sampled.cache == "miss" and sampled.headers.get("x-kvgate-semantic-skipped") == "sampling"
