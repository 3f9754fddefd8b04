"""Everything done to a request before it goes upstream: canonical body, prefix-break
diagnostics, and the prefix blocks the router and the usage estimate use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.canonical.diagnostics import PrefixTracker, session_key
from gateway.canonical.fingerprints import PrefixBlock, prefix_blocks
from gateway.canonical.rules import canonicalize
from gateway.canonical.settings import CanonicalSettings
from gateway.usage.tokens import get_encoding, render_prompt


@dataclass(slots=True)
class Prepared:
    """A request made ready for the cache and the router. Its prefix blocks are cut only when
    something asks for them (the router, on a miss): an exact hit pays no tokenizer pass."""

    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    breaks: list[str] = field(default_factory=list)
    layout: list[str] = field(default_factory=list)
    volatile: list[str] = field(default_factory=list)
    cut: Callable[[dict[str, Any]], list[PrefixBlock]] | None = None
    _blocks: list[PrefixBlock] | None = None

    @property
    def blocks(self) -> list[PrefixBlock]:
        if self._blocks is None:
            self._blocks = self.cut(self.body) if self.cut is not None else []
        return self._blocks

    def with_body(self, body: dict[str, Any]) -> Prepared:
        """The same preparation for another body (compacted, truncated): its blocks cut afresh."""
        return Prepared(body, self.headers, self.breaks, self.layout, self.volatile, self.cut)


class Preparer:
    def __init__(self, canonical: CanonicalSettings, *, encoding: str, block_tokens: int,
                 on_break: Callable[[str, str, str | None], None] | None = None) -> None:
        """`encoding`, `block_tokens`: how prompts are cut into prefix blocks (the router's settings).
        `on_break(reason, tenant, model)` is told of every prefix break (metrics, dashboard)."""
        self._canonical = canonical
        self._block_tokens = block_tokens
        self._tracker = PrefixTracker(canonical.track_sessions)
        self._encoding = get_encoding(encoding)
        self._on_break = on_break

    def prepare(self, tenant: str, body: dict[str, Any], *, chat: bool, session: str | None) -> Prepared:
        prepared = Prepared(body)
        if chat:
            result = canonicalize(body, self._canonical)
            prepared.body = result.body
            prepared.volatile = result.volatile
            if result.applied:
                prepared.headers["x-kvgate-canonical"] = ",".join(result.applied)
            if result.volatile:
                prepared.headers["x-kvgate-volatile"] = ",".join(result.volatile)
            observed = self._tracker.observe(session_key(tenant, result.body, session), result.body)
            prepared.breaks, prepared.layout = observed.breaks, observed.layout
            if prepared.breaks:
                prepared.headers["x-kvgate-prefix-break"] = ",".join(prepared.breaks)
            if prepared.layout:
                prepared.headers["x-kvgate-layout"] = ",".join(prepared.layout)
            if self._on_break:
                for reason in [*prepared.breaks, *prepared.layout]:
                    self._on_break(reason, tenant, body.get("model"))
        prepared.cut = self.prefix_blocks
        return prepared

    def prefix_blocks(self, body: dict[str, Any]) -> list[PrefixBlock]:
        """The prompt cut into chain-hashed token blocks (one tiktoken pass over the prompt)."""
        return prefix_blocks(self._encoding.encode(render_prompt(body), disallowed_special=()), self._block_tokens)
