"""What a semantic lookup says it saw, through the real gateway and the openai SDK, on SQLite and
PostgreSQL: a judged lookup, hit or miss, gives the judge's probability; a lookup the cheap stage
ended says why (no stored question, none within the floor, the prejudge, a veto) and how close it
came (the nearest stored question's sketch cosine), with nothing embedded or judged to say it."""

from __future__ import annotations

import httpx
import pytest

from gateway.responsecache.semantic.sketch import Sketcher
from tests.conftest import Gateway
from tests.responsecache.conftest import ADMIN, Client

NO_STORE = {"cache-control": "no-store"}


def judged_count(gw: Gateway) -> int:
    reply = httpx.get(gw.base_url + "/admin/response-cache/stats", headers=ADMIN)
    reply.raise_for_status()
    return int(reply.json()["semantic_judged"])


def test_a_judged_lookup_gives_the_judges_probability_on_a_hit_and_on_a_miss(gw: Gateway) -> None:
    client = Client(gw)
    space = {"x-kvgate-cache-namespace": "judge-probability"}
    client.miss_then_stored("How do I reset the password of my wifi router?", headers=space)
    hit = client.chat("How can I reset my wifi router password?", headers={**space, **NO_STORE})
    assert hit.cache == "hit-semantic" and hit.headers["x-kvgate-semantic-stage"] == "judged", hit.headers
    probability = float(hit.headers["x-kvgate-judge-probability"])
    assert 0 < probability <= 1
    # A bar no probability reaches: judged, turned down, and it says by how much.
    miss = client.chat("How can I reset my wifi router password?",
                       headers={**space, **NO_STORE, "x-kvgate-semantic-threshold": "1.0"})
    assert miss.cache == "miss" and miss.headers["x-kvgate-semantic-stage"] == "judged", miss.headers
    assert float(miss.headers["x-kvgate-judge-probability"]) == pytest.approx(probability, abs=1e-3)
    assert "x-kvgate-semantic-ruled-out" not in miss.headers and miss.similarity is not None


@pytest.mark.parametrize("stored, asked, reason", [
    (None, "Why did my pressure cooker explode?", "no-candidate"),
    ("What is a pressure cooker?", "How many moons does the planet Jupiter have?", "below-floor"),
    # Within the sketch floor, but the prejudge's trees say the judge would turn it down.
    ("What is a pressure cooker?", "Why did my pressure cooker explode?", "prejudge"),
    # The trees would let it through; the judge's number rule never serves it.
    ("What is 15 percent of 200?", "What is 25 percent of 200?", "veto"),
])
def test_a_ruled_out_lookup_says_why(gw: Gateway, stored: str | None, asked: str, reason: str) -> None:
    client = Client(gw)
    space = {"x-kvgate-cache-namespace": f"ruled-out-{reason}"}
    if stored is not None:
        client.miss_then_stored(stored, headers=space)
    judged = judged_count(gw)
    miss = client.chat(asked, headers={**space, **NO_STORE})
    assert miss.cache == "miss" and miss.headers["x-kvgate-semantic-stage"] == "ruled-out", miss.headers
    assert miss.headers["x-kvgate-semantic-ruled-out"] == reason
    assert "x-kvgate-judge-probability" not in miss.headers
    assert judged_count(gw) == judged, "nothing is judged to say why"
    if stored is None:
        assert miss.similarity is None, "no stored question: no similarity"
        return
    # How close it came: the nearest stored question's sketch cosine, exact to the header's digits.
    sketcher = Sketcher.load()
    expected = float(sketcher.sketch(asked) @ sketcher.sketch(stored))
    assert miss.similarity == pytest.approx(expected, abs=1e-4), miss.headers
    floor = sketcher.floor(asked)
    assert (miss.similarity < floor) if reason == "below-floor" else (miss.similarity >= floor)
