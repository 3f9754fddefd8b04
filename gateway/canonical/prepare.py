"""Everything done to a request before it goes upstream: canonical body, prefix-break
diagnostics, and the prefix blocks the router and the usage estimate use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.canonical.diagnostics import PrefixTracker, session_key
from gateway.canonical.rules import canonicalize
from gateway.canonical.settings import CanonicalSettings
from gateway.upstream.prefix_index import PrefixBlock, prefix_blocks
from gateway.upstream.settings import RoutingSettings
from gateway.usage.tokens import get_encoding, render_prompt


@dataclass(slots=True)
class Prepared:
    body: dict[str, Any]
    blocks: list[PrefixBlock] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    breaks: list[str] = field(default_factory=list)
    layout: list[str] = field(default_factory=list)
    volatile: list[str] = field(default_factory=list)


class Preparer:
    def __init__(self, canonical: CanonicalSettings, routing: RoutingSettings,
                 on_break: Callable[[str, str, str | None], None] | None = None) -> None:
        """`on_break(reason, tenant, model)` is told of every prefix break (metrics, dashboard)."""
        self._canonical = canonical
        self._routing = routing
        self._tracker = PrefixTracker(canonical.track_sessions)
        self._encoding = get_encoding(routing.encoding)
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
        ids = self._encoding.encode(render_prompt(prepared.body), disallowed_special=())
        prepared.blocks = prefix_blocks(ids, self._routing.block_tokens)
        return prepared
