"""Issue 54 in front of a real llama-server with one 4,096-token slot: a 40-message conversation of
about 8,100 tokens (SmolLM2's) that no turn ever sent before.

- without an opt-in: 400 `context_length_exceeded`, naming the opt-ins;
- `x-kvgate-compact: on`: 200, the history summarised in several calls, each beginning with the
  previous call's prefix (llama.cpp's own cached tokens show it), and the next turn, sent as the
  client sends it (the summary kept), served from the slot's cache;
- `/v1/responses` through the openai SDK: `truncation: "auto"` answers, `"disabled"` is a 400.

The context is read from the server's /props before the first request: nothing is sent that does
not fit. Each test prints the figures it measured (`pytest -s`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.pipeline.compaction import CompactionSettings
from tests.llamacpp.test_differences import MODEL, Servers, kvgate, sentences

SLOT_TOKENS = 4096
SYSTEM = ("You are the archivist of a large library. You keep an exact record of every shelf, box and "
          "note the user files with you, answer questions about them briefly and precisely, and never "
          "invent a shelf, a box or a note that was not filed. " + sentences(12, "the rules"))


def long_conversation() -> list[dict[str, Any]]:
    """40 messages, 8,082 tokens as SmolLM2's chat template renders them: the instructions (236), 19
    exchanges of about 200 tokens a message, the question."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for part in range(19):
        messages.append({"role": "user", "content": f"File part {part}. " + sentences(12, f"shelf {part}")})
        messages.append({"role": "assistant",
                         "content": f"Filed part {part}, as you asked. " + sentences(11, f"box {part}")})
    messages.append({"role": "user", "content": "Which shelf held part 0?"})
    return messages


def cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_a_history_twice_the_slot_is_compacted_in_calls_that_share_their_prefix(llama_servers: Servers,
                                                                              tmp_path: Path) -> None:
    servers = llama_servers(1, slots=1, ctx_per_slot=SLOT_TOKENS, threads=2)
    messages = long_conversation()
    assert len(messages) == 40
    body = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0}
    # Summaries of 64 tokens: three or four summary calls take minutes on two busy cores.
    with kvgate(tmp_path, servers, compaction=CompactionSettings(max_summary_tokens=64)) as front:

        def post(payload: dict[str, Any], **headers: str) -> httpx.Response:
            return httpx.post(front.url + "/v1/chat/completions", json=payload, timeout=900,
                              headers={"authorization": f"Bearer {front.key}", **headers})

        refused = post(body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "context_length_exceeded" and "x-kvgate-compact: on" in error["message"]
        prompt_tokens = int(error["message"].split("your request has ")[1].split()[0])

        compacted = post(body, **{"x-kvgate-compact": "on"})
        assert compacted.status_code == 200, compacted.text
        assert compacted.headers["x-kvgate-compacted"] == "38"  # all but the instructions and the question
        answer = compacted.json()
        compaction = answer["kvgate"]["compaction"]
        calls = compaction["calls"]
        assert len(calls) >= 2, calls
        assert all(u["prompt_tokens"] + 64 <= SLOT_TOKENS for u in calls), calls
        # Each call after the first begins with what the one before it began with (the instructions,
        # then the summary so far): the slot had it, llama.cpp counts it as cached.
        assert all(cached(u) >= 150 and u["usage_source"] == "upstream" for u in calls[1:]), calls

        reply = {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
        next_turn = {**body, "messages": [messages[0], compaction["message"], messages[-1], reply,
                                          {"role": "user", "content": "And part 1?"}]}
        followed = post(next_turn, **{"x-kvgate-compact": "on"})
        assert followed.status_code == 200, followed.text
        assert "x-kvgate-compacted" not in followed.headers
        usage = followed.json()["usage"]
        continued_prompt = answer["usage"]["prompt_tokens"]
        assert cached(usage) >= continued_prompt - 4, (usage, continued_prompt)
        print(json.dumps({"conversation_messages": len(messages), "prompt_tokens": prompt_tokens,
                          "refused_without_opt_in": refused.status_code, "compacted_status": compacted.status_code,
                          "replaced_messages": compaction["replaced_messages"], "summary_calls": [
                              {"prompt_tokens": u["prompt_tokens"], "cached_tokens": cached(u)} for u in calls],
                          "continued_prompt_tokens": continued_prompt,
                          "next_turn": {"prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached(usage)},
                          "compaction_ms": compaction["compaction_ms"]}))


def test_responses_truncation_auto_answers_and_disabled_is_a_400(llama_servers: Servers, tmp_path: Path) -> None:
    servers = llama_servers(1, slots=1, ctx_per_slot=SLOT_TOKENS, threads=2)
    messages = long_conversation()
    items: Any = [{"role": m["role"], "content": m["content"]} for m in messages[1:]]
    with kvgate(tmp_path, servers) as front:
        client = openai.OpenAI(base_url=front.url + "/v1", api_key=front.key, max_retries=0, timeout=900)
        raw = client.responses.with_raw_response.create(model=MODEL, instructions=SYSTEM, input=items,
                                                        truncation="auto", max_output_tokens=16)
        response = raw.parse()
        assert response.status in ("completed", "incomplete") and response.truncation == "auto"
        dropped = int(raw.headers["x-kvgate-truncated"])
        assert 0 < dropped < len(items) and response.usage is not None
        assert response.usage.input_tokens + 16 <= SLOT_TOKENS
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, instructions=SYSTEM, input=items, truncation="disabled",
                                    max_output_tokens=16)
        assert refused.value.status_code == 400 and refused.value.code == "context_length_exceeded"
        print(json.dumps({"truncation_auto": {"status": raw.status_code, "dropped_messages": dropped,
                                              "input_tokens": response.usage.input_tokens},
                          "truncation_disabled": {"status": refused.value.status_code,
                                                  "code": refused.value.code}}))
