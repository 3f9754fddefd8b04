"""Prefix blocks are cut only when the router asks for them (issue 14: an exact hit paid a full
tiktoken encode of the prompt before the cache lookup)."""

from __future__ import annotations

from typing import Any

from gateway.canonical.prepare import Preparer
from gateway.canonical.settings import CanonicalSettings

BODY = {"model": "m", "messages": [{"role": "system", "content": "You are terse. " * 200},
                                   {"role": "user", "content": "hello"}]}


def test_blocks_are_cut_on_first_use_only() -> None:
    preparer = Preparer(CanonicalSettings(), encoding="o200k_base", block_tokens=16)
    calls: list[dict[str, Any]] = []
    cut = preparer.prefix_blocks

    def counting(body: dict[str, Any]) -> list[Any]:
        calls.append(body)
        return cut(body)

    prepared = preparer.prepare("t", BODY, chat=True, session=None)
    prepared.cut = counting
    assert calls == []
    blocks = prepared.blocks
    assert len(blocks) >= 10 and prepared.blocks is blocks
    assert len(calls) == 1
    assert blocks == preparer.prefix_blocks(prepared.body)
