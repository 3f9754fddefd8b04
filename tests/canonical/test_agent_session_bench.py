"""`kvgate bench agent-session` on a short session: the rows it prints follow from the usage the
upstream reported, and canonicalization wins back what a mistaken client loses."""

from __future__ import annotations

import json

import pytest

from bench import agent_session


def test_agent_session_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert agent_session.main(["--json", "--turns", "6", "--prefix-tokens", "1500", "--no-engine"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["scenario"], r["canonical"]): r for r in out["rows"]}
    assert set(rows) == {(s, c) for s in agent_session.SCENARIOS for c in (False, True)}
    for row in rows.values():
        assert row["cache_read_tokens"] + row["cache_creation_tokens"] == row["input_tokens"]
        assert row["cost_usd"] <= row["cost_without_cache_usd"]
    clean = rows[("clean", True)]
    assert clean["saved_share"] > 0.5 and clean["prefix_breaks"] == {}
    # a timestamp at the top of the system prompt loses the whole cache, unless it is hoisted
    assert rows[("timestamp", False)]["cache_read_tokens"] == 0
    assert rows[("timestamp", False)]["prefix_breaks"]["system_prompt_edited"] == 5
    assert rows[("timestamp", True)]["saved_share"] == pytest.approx(clean["saved_share"], abs=0.05)
    assert rows[("shuffled_tools", True)]["cache_read_tokens"] > rows[("shuffled_tools", False)]["cache_read_tokens"]
    # what canonicalization cannot undo: a model switch starts a cold cache, and says so
    assert rows[("model_switch", True)]["prefix_breaks"] == {"model_switched": 1}
    assert rows[("model_switch", True)]["cache_read_tokens"] < clean["cache_read_tokens"]
    assert rows[("mistaken", True)]["saved_share"] > rows[("mistaken", False)]["saved_share"]
