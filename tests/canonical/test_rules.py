"""Canonicalization keeps meaning and makes equivalent static prefixes byte-identical."""

from __future__ import annotations

import copy
import random
from typing import Any

import orjson

from gateway.canonical.diagnostics import (
    HISTORY_REWRITTEN,
    MODEL_SWITCHED,
    SYSTEM_EDITED,
    TOOLS_CHANGED,
    PrefixTracker,
    session_key,
)
from gateway.canonical.rules import canonicalize
from gateway.canonical.settings import CanonicalSettings, VolatilePolicy
from gateway.canonical.volatile import find_volatile

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.  \r\nReturns celsius.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "City name"},
                                  "unit": {"type": "string", "enum": ["c", "f"]}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


def shuffled(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: shuffled(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [shuffled(v, rng) for v in value]
    return value


def agent_request(system: str, tools: list[Any]) -> dict[str, Any]:
    return {"model": "m", "tools": tools, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "What's the weather in Paris on 2026-12-02?  "},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 7}"},
    ]}


def test_shuffled_tool_schemas_give_one_prefix() -> None:
    settings = CanonicalSettings()
    rng = random.Random(7)
    outputs = set()
    for _ in range(10):
        tools = shuffled([WEATHER, SEARCH], rng)
        rng.shuffle(tools)
        out = canonicalize(agent_request("You are helpful.", tools), settings)
        outputs.add(orjson.dumps({"tools": out.body["tools"], "system": out.body["messages"][0]}))
    assert len(outputs) == 1


def test_user_turns_and_order_are_untouched() -> None:
    request = agent_request("You are helpful.\r\nBe brief.   ", [SEARCH, WEATHER])
    original = copy.deepcopy(request)
    out = canonicalize(request, CanonicalSettings(volatile_policy=VolatilePolicy.HOIST))
    assert request == original, "the client's body is never mutated"
    assert out.body["messages"][1:4] == original["messages"][1:4]
    assert [m["role"] for m in out.body["messages"][:4]] == [m["role"] for m in original["messages"]]
    assert out.body["messages"][0]["content"] == "You are helpful.\nBe brief."
    assert {"tools-sorted", "system-whitespace", "tool-whitespace"} <= set(out.applied)


def test_hoist_keeps_the_value_visible_and_the_prefix_stable() -> None:
    settings = CanonicalSettings(volatile_policy=VolatilePolicy.HOIST)
    a = canonicalize(agent_request("Now: 2026-12-02T14:00:00Z. Session 3f2b8c1e-9a7d-4e21-b5c3-0f1e2d3c4b5a.", []),
                     settings)
    b = canonicalize(agent_request("Now: 2026-12-02T14:05:31Z. Session 7c9e6679-7425-40de-944b-e07fc1f90ae7.", []),
                     settings)
    assert a.body["messages"][0] == b.body["messages"][0]
    assert "2026-12-02T14:00:00Z" not in a.body["messages"][0]["content"]
    note = a.body["messages"][-1]
    assert note["role"] == "system" and "2026-12-02T14:00:00Z" in note["content"]
    assert "3f2b8c1e-9a7d-4e21-b5c3-0f1e2d3c4b5a" in note["content"]
    assert a.volatile == ["iso_datetime", "uuid"] and "volatile-hoisted" in a.applied


def test_warn_reports_without_changing() -> None:
    out = canonicalize(agent_request("Today is 2026-12-02, epoch 1764684000.", []), CanonicalSettings())
    assert out.body["messages"][0]["content"] == "Today is 2026-12-02, epoch 1764684000."
    assert out.volatile == ["iso_date", "epoch"]


def test_rules_can_be_switched_off() -> None:
    off = CanonicalSettings(sort_tool_keys=False, sort_tools=False, normalize_whitespace=False,
                            sort_response_format_keys=False, volatile_policy=VolatilePolicy.OFF)
    request = agent_request("x\r\n", [SEARCH, WEATHER])
    out = canonicalize(request, off)
    assert out.body == request and out.applied == [] and out.volatile == []


def test_volatile_patterns() -> None:
    kinds = [v.kind for v in find_volatile(
        "at 2026-12-02 12:00:01+01:00 id req_8f7e6d5c4b3a, ts 1764684000123, plain 2026-01-05, 10:11:12")]
    assert kinds == ["iso_datetime", "request_id", "epoch", "iso_date", "time"]
    assert find_volatile("version 3.11 costs 12 dollars, call 555-1234") == []


def test_prefix_break_reasons() -> None:
    tracker = PrefixTracker(100)
    base = agent_request("sys", [WEATHER])
    key = session_key("t", base, None)
    assert tracker.observe(key, base).breaks == []
    grown = {**base, "messages": [*base["messages"], {"role": "assistant", "content": "7 degrees"},
                                  {"role": "user", "content": "thanks"}]}
    assert tracker.observe(key, grown).breaks == []
    assert tracker.observe(key, {**grown, "model": "other"}).breaks == [MODEL_SWITCHED]
    assert tracker.observe(key, {**grown, "model": "other", "tools": [WEATHER, SEARCH]}).breaks == [TOOLS_CHANGED]
    edited = copy.deepcopy(grown)
    edited.update(model="other", tools=[WEATHER, SEARCH])
    edited["messages"][0]["content"] = "sys v2"
    assert tracker.observe(key, edited).breaks == [SYSTEM_EDITED]
    rewritten = copy.deepcopy(edited)
    rewritten["messages"][2]["content"] = "I rewrote my earlier answer"
    assert tracker.observe(key, rewritten).breaks == [HISTORY_REWRITTEN]
    assert session_key("t", base, "abc") != session_key("t", base, None) != session_key("u", base, None)
