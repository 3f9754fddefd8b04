"""The staged semantic lookup through the real gateway: a miss no stored question could answer is
ended by the cheap stage (nothing embedded); a stored question is embedded only when a lookup first
needs it, and that embedding reaches SQL; a paraphrase is still served."""

from __future__ import annotations

import time

import httpx
import sqlalchemy as sa

from tests.conftest import Gateway
from tests.responsecache.conftest import ADMIN, Client


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
