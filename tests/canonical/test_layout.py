"""Layout advice: a changing zone placed in front of a stable one is flagged, one test per order."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.canonical.diagnostics import PrefixTracker, Zone, layout_warning, session_key

RULES = "Follow the store's refund policy. " * 20  # a long stable instruction text
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
OTHER_TOOLS = [{"type": "function", "function": {"name": "lookup_v2", "parameters": {"type": "object"}}}]
DOCS = "Handbook section 4: refunds within 30 days. " * 10


def request(system: str | None = RULES, tools: list[Any] | None = None, docs: str | None = None,
            turns: int = 1, last: str = "what is the refund window?") -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system is not None else []
    if docs is not None:
        messages.append({"role": "user", "content": docs})
    for i in range(turns - 1):
        messages += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    messages.append({"role": "user", "content": last})
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if tools is not None:
        body["tools"] = tools
    return body


def warnings(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    tracker = PrefixTracker(10)
    tracker.observe("s", first)
    return tracker.observe("s", second).layout


CASES = [
    # a timestamp at the top of a long system prompt: its stable tail is re-prefilled every turn
    ((Zone.INSTRUCTIONS, Zone.INSTRUCTIONS),
     request("Now: 10:00:01. " + RULES, turns=2), request("Now: 10:00:09. " + RULES, turns=3)),
    ((Zone.INSTRUCTIONS, Zone.TOOLS),
     request("Now: 10:00:01.", TOOLS, turns=2), request("Now: 10:00:09.", TOOLS, turns=3)),
    ((Zone.INSTRUCTIONS, Zone.DOCUMENTS),
     request("Now: 10:00:01.", docs=DOCS), request("Now: 10:00:09.", docs=DOCS)),
    ((Zone.INSTRUCTIONS, Zone.TURNS),
     request("Now: 10:00:01.", turns=2), request("Now: 10:00:09.", turns=3)),
    ((Zone.TOOLS, Zone.DOCUMENTS),
     request(tools=TOOLS, docs=DOCS), request(tools=OTHER_TOOLS, docs=DOCS)),
    ((Zone.TOOLS, Zone.TURNS),
     request(tools=TOOLS, turns=2), request(tools=OTHER_TOOLS, turns=3)),
    # a per-request note prepended to a long stable document
    ((Zone.DOCUMENTS, Zone.DOCUMENTS),
     request(docs="Fetched 10:00:01. " + DOCS), request(docs="Fetched 10:00:09. " + DOCS)),
    ((Zone.DOCUMENTS, Zone.TURNS),
     request(docs="doc v1", turns=2), request(docs="doc v2", turns=3)),
]


@pytest.mark.parametrize(("zones", "first", "second"), CASES, ids=[f"{a}-before-{b}" for (a, b), _, _ in CASES])
def test_changed_zone_before_stable_zone_is_flagged(zones: tuple[Zone, Zone], first: dict[str, Any],
                                                    second: dict[str, Any]) -> None:
    assert warnings(first, second) == [layout_warning(*zones)]


def test_good_layouts_are_not_flagged() -> None:
    # a growing conversation behind a stable prefix
    assert warnings(request(tools=TOOLS, docs=DOCS, turns=1), request(tools=TOOLS, docs=DOCS, turns=4)) == []
    # the dynamic value carried in the newest turn, where it belongs
    assert warnings(request(tools=TOOLS, turns=2, last="Now: 10:00:01. next?"),
                    request(tools=TOOLS, turns=3, last="Now: 10:00:09. next?")) == []
    # a changing system prompt with nothing stable after it loses nothing else
    assert warnings(request("Now: 10:00:01."), request("Now: 10:00:09.", last="something else")) == []


def test_rewritten_history_is_a_prefix_break_not_a_layout_warning() -> None:
    tracker = PrefixTracker(10)
    first = request(tools=TOOLS, turns=3)
    tracker.observe("s", first)
    edited = request(tools=TOOLS, turns=4)
    edited["messages"][1]["content"] = "question 0, edited"
    observed = tracker.observe("s", edited)
    assert observed.breaks == ["history_rewritten"] and observed.layout == []


def test_session_key_is_unchanged_by_layout_units() -> None:
    body = request(tools=TOOLS)
    assert session_key("t", body, None) == session_key("t", request(tools=OTHER_TOOLS), None)
