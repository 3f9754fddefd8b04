"""Through the gateway in front of the fake upstream: the upstream reads the condensed context,
the question, system prompt and tools untouched, and the response's usage says what was cut."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.responsecache.settings import ResponseCacheSettings
from gateway.usage.tokens import get_encoding, render_prompt
from tests.conftest import Gateway, start_gateway
from tests.fake_upstream import create_fake_upstream
from tests.servers import serve_in_thread

DATA = Path(__file__).resolve().parents[2] / "bench" / "data" / "squad2_dev_5articles.jsonl.gz"
SYSTEM = "You answer from the documents only.   Be brief."
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a term up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def documents() -> list[str]:
    with gzip.open(DATA, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines]
    normans = [r["context"] for r in rows if r["title"] == "Normans"]
    return ["\n\n".join(normans[:5]), "\n\n".join(normans[5:10])]


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    # A fake that counts the whole rendered prompt (not only the last turn) in usage.prompt_tokens.
    with serve_in_thread(create_fake_upstream(prefix_cache_blocks=4096)) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    database_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('condense') / 'kvgate.db'}"
    # The response cache is not what is tested here: off, the gateway starts without loading the
    # embedding model.
    yield from start_gateway(upstream, database_url, max_body_bytes=1024 * 1024,
                             responsecache=ResponseCacheSettings(enabled=False, semantic=False))


def _post(gateway: Gateway, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(gateway.v1 + "/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {gateway.api_key}", "cache-control": "no-store, no-cache",
                               **(headers or {})})


def _received(upstream: str) -> dict[str, Any]:
    state: dict[str, Any] = httpx.get(upstream + "/control/state").json()
    return state["last_request"]


def _tokens(text: str) -> int:
    return len(get_encoding().encode_ordinary(text))


def test_upstream_reads_condensed_documents(gateway: Gateway, upstream: str, documents: list[str]) -> None:
    question = "Who was the Norse leader?"
    body = {
        "model": "fake-model", "tools": TOOLS,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": documents[0]},
                                         {"type": "text", "text": documents[1]},
                                         {"type": "text", "text": question}]},
        ],
        "kvgate": {"condense": {"ratio": 3, "min_tokens": 100}},
    }
    response = _post(gateway, body)
    assert response.status_code == 200, response.text
    sent = _received(upstream)
    assert "kvgate" not in sent
    assert sent["tools"] == TOOLS
    assert sent["messages"][0] == {"role": "system", "content": SYSTEM}
    parts = sent["messages"][1]["content"]
    assert parts[2] == {"type": "text", "text": question}
    for original, part in zip(documents, parts[:2], strict=True):
        assert _tokens(part["text"]) <= _tokens(original) / 2
    assert "Rollo" in parts[0]["text"]

    usage = response.json()["usage"]
    # What the upstream would have read without condensing: what it received, documents put back
    # (the system prompt it received is the canonical one, whitespace normalized).
    restored = [{"type": "text", "text": d} for d in documents] + [parts[2]]
    original_prompt = _tokens(render_prompt({**sent, "messages": [sent["messages"][0],
                                                                  {"role": "user", "content": restored}]}))
    assert usage["prompt_tokens"] < original_prompt / 2
    # The fake renders content lists as JSON (newlines and quotes escaped), so its count of the
    # same text differs by a few tokens from the raw-text count condensing reports.
    assert abs(usage["kvgate"]["condensed_from_tokens"] - original_prompt) <= 0.02 * original_prompt
    extension = usage["kvgate"]
    assert extension["condensed_tokens_saved"] == extension["condensed_from_tokens"] - usage["prompt_tokens"]
    before, after = (int(n) for n in response.headers["x-kvgate-condensed"].split("->"))
    assert before == sum(_tokens(d) for d in documents) and after < before / 2
    assert usage["kvgate"]["condensed_tokens_saved"] == before - after


def test_header_condenses_long_tool_results_when_streaming(gateway: Gateway, upstream: str,
                                                           documents: list[str]) -> None:
    question = "What religion were the Normans?"
    body = {
        "model": "fake-model", "stream": True, "stream_options": {"include_usage": True},
        "messages": [
            {"role": "user", "content": "Find out about the Normans."},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": documents[0]},
            {"role": "user", "content": question},
        ],
    }
    with httpx.stream("POST", gateway.v1 + "/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {gateway.api_key}", "x-kvgate-condense": "2",
                               "cache-control": "no-store, no-cache"}) as response:
        assert response.status_code == 200
        assert "x-kvgate-condensed" in response.headers
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    sent = _received(upstream)
    assert sent["messages"][0]["content"] == "Find out about the Normans."
    assert sent["messages"][3]["content"] == question
    tool_text = sent["messages"][2]["content"]
    assert _tokens(tool_text) < _tokens(documents[0]) * 0.6
    assert "Catholic" in tool_text
    usage = next(e["usage"] for e in events if e.get("usage"))
    assert usage["kvgate"]["condensed_from_tokens"] > usage["prompt_tokens"]


def test_not_condensed_unless_asked(gateway: Gateway, upstream: str, documents: list[str]) -> None:
    body = {"model": "fake-model", "messages": [
        {"role": "user", "content": [{"type": "text", "text": documents[0]}, {"type": "text", "text": "Who?"}]}]}
    response = _post(gateway, body)
    assert response.status_code == 200
    assert _received(upstream)["messages"] == body["messages"]
    assert "kvgate" not in response.json()["usage"]
    assert "x-kvgate-condensed" not in response.headers


def test_short_context_and_bad_ratio(gateway: Gateway, upstream: str) -> None:
    body = {"model": "fake-model", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "A short note."}, {"type": "text", "text": "Why?"}]}]}
    response = _post(gateway, body, {"x-kvgate-condense": "on"})
    assert response.status_code == 200
    assert _received(upstream)["messages"] == body["messages"]
    bad = _post(gateway, {**body, "kvgate": {"condense": {"ratio": 0.5}}})
    assert bad.status_code == 422
    assert bad.json()["error"]["param"] == "kvgate.condense.ratio"


def test_dashboard_and_metrics_count_condensed_tokens(gateway: Gateway, documents: list[str]) -> None:
    body = {"model": "fake-model", "messages": [
        {"role": "user", "content": [{"type": "text", "text": documents[1]}, {"type": "text", "text": "When?"}]}]}
    response = _post(gateway, body, {"x-kvgate-condense": "4"})
    assert response.status_code == 200
    saved = response.json()["usage"]["kvgate"]["condensed_tokens_saved"]
    assert saved > 0
    admin = {"authorization": "Bearer admin-test-key"}
    deadline = time.monotonic() + 10
    while True:  # the request log is written in the background, a few times a second
        summary = httpx.get(gateway.base_url + "/dashboard/api/summary", headers=admin).json()
        if summary["overview"]["tokens_saved"]["condensing"] >= saved or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert summary["overview"]["tokens_saved"]["condensing"] >= saved
    assert summary["overview"]["cost_saved_usd"]["condensing"] > 0
    metrics = httpx.get(gateway.base_url + "/metrics", headers=admin).text
    assert 'kvgate_saved_tokens_total{source="condensing"}' in metrics
