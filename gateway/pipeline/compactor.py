"""The fit stage: an opted-in chat request that does not fit its upstream's context is compacted
(summarised in as many calls as it takes, gateway/pipeline/compaction.py) or truncated before it is
sent, and again, with the upstream's own numbers, when the upstream refuses it anyway.

    fits?  -> forwarded as it is
    truncate (truncation "auto")       drop the oldest history messages until it fits
    compact  (x-kvgate-compact: on)    summary calls, oldest piece first, each beginning with the
                                       previous call's prefix; then the summary and the newest turn

Which upstream's context: the smallest one known among those serving the model
(gateway/upstream/context.py). Unknown (the upstream publishes none and has not refused anything
yet): the request goes as it is, and the refusal tells the context.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.errors import GatewayError, InvalidRequest
from gateway.pipeline.call import Call, Route, tenant_salt
from gateway.pipeline.compaction import (
    Compaction,
    CompactionSettings,
    continued_request,
    is_context_overflow,
    piece_request,
    summary_note,
    summary_text,
    summed_usage,
)
from gateway.pipeline.fit import Budget, answer_reserve, check_newest_turn, layout, piece_end, truncated
from gateway.upstream.backend import JSONObject
from gateway.upstream.context import ContextWindows
from gateway.upstream.prefix_index import PrefixBlock
from gateway.upstream.router import Router
from gateway.usage.accounting import Accountant

FITTED_ROUTES = (Route.CHAT, Route.RESPONSES)
# Refusals of one request (or one of its summary calls) that are fitted again with the refusal's numbers.
MAX_REFITS = 2
UNKNOWN_CONTEXT = 1 << 62
Cut = Callable[[JSONObject], list[PrefixBlock]]


class ContextFit:
    def __init__(self, router: Router, windows: ContextWindows, accountant: Accountant,
                 settings: CompactionSettings) -> None:
        self.router = router
        self.windows = windows
        self.accountant = accountant
        self.settings = settings

    def wanted(self, call: Call) -> bool:
        return call.route in FITTED_ROUTES and (call.compact or call.truncate)

    async def budget(self, call: Call) -> Budget | None:
        serving = await self.router.serving(call.model)
        await self.windows.probe(serving)
        context = self.windows.tokens(serving, call.model)
        return Budget(context, self.windows.ratio(call.model)) if context is not None else None

    async def apply(self, call: Call, cut: Cut | None = None, *, refused: bool = False) -> bool:
        """Make `call.body` fit, if the call opted in and the context is known; True when the body
        changed. `refused`: the upstream refused this body as too long (whatever the estimate says);
        a compaction then goes ahead even with the context unknown, in one summary call. Refusals
        (`context_length_exceeded`) say what cannot be made to fit."""
        if not self.wanted(call):
            return False
        budget = await self.budget(call)
        if budget is None:
            if not (refused and call.compact):
                return False
            budget = Budget(UNKNOWN_CONTEXT, self.windows.ratio(call.model))
        body = call.body
        reserve = answer_reserve(body, self.settings.reserve_tokens)
        if not refused and budget.fits(body.get("messages") or [], body.get("tools"), reserve):
            return False
        if call.compact:
            return await self._compact(call, budget, reserve, cut)
        call.body, dropped = truncated(body, budget, reserve)
        call.truncated = (call.truncated or 0) + dropped
        return dropped > 0

    def learn(self, call: Call, exc: GatewayError) -> None:
        """A refusal's numbers (the upstream's context, its count of the prompt) for the next fit;
        a refusal without a count weighs messages a quarter heavier from now on."""
        estimated = Budget(1, 1.0).raw(call.body.get("messages") or [], call.body.get("tools"))
        overflow = self.windows.learn(exc.upstream, call.model, exc.message, estimated)
        if overflow.prompt_tokens is None:
            self.windows.weigh_heavier(call.model, 1.25)

    async def _compact(self, call: Call, budget: Budget, reserve: int, cut: Cut | None) -> bool:
        body = call.body
        messages = list(body.get("messages") or [])
        tools = body.get("tools")
        at = layout(messages)
        if at is None:
            return False
        check_newest_turn(messages, at, tools, budget, reserve)
        if at.leading == at.newest:
            return False
        statics, history, tail = messages[:at.leading], messages[at.leading:at.newest], messages[at.newest:]
        summary_reserve = self.settings.max_summary_tokens
        started = time.perf_counter()
        summaries: list[str] = []
        calls: list[dict[str, Any]] = []
        start = 0
        # Refused with the context unknown: one summary call, whatever its size (the old behaviour).
        while start < len(history) or (budget.context_tokens != UNKNOWN_CONTEXT and
                                       not budget.fits([*statics, summary_note(summaries), *tail], tools, reserve)):
            if len(calls) >= self.settings.max_summary_calls:
                raise InvalidRequest(f"compaction needs more than {self.settings.max_summary_calls} summary calls "
                                     "(KVGATE_COMPACTION__MAX_SUMMARY_CALLS)", param="messages",
                                     code="context_length_exceeded")
            if start == len(history):  # all summarised, the summaries too long beside the newest turn
                if len(summaries) < 2:
                    raise InvalidRequest("the summary and the newest turn do not fit the context; lower "
                                         "KVGATE_COMPACTION__MAX_SUMMARY_TOKENS", param="messages",
                                         code="context_length_exceeded")
                summaries = await self._consolidated(call, body, at.leading, summaries, budget, calls, cut)
                continue
            instruction = self.settings.continue_instruction if summaries else self.settings.instruction
            note = [summary_note(summaries)] if summaries else []
            fixed = [*statics, *note, {"role": "user", "content": instruction}]
            end = piece_end(budget, fixed, history, start, tools, summary_reserve)
            if end == start:
                if len(summaries) < 2:
                    raise InvalidRequest(
                        f"message {at.leading + start} is too long to summarise within the context of "
                        f"{budget.context_tokens} tokens (beside the instructions and the summary so far)",
                        param="messages", code="context_length_exceeded")
                summaries = await self._consolidated(call, body, at.leading, summaries, budget, calls, cut)
                continue
            summary = await self._summarise(call, body, at.leading, summaries, history[start:end], budget, calls, cut)
            if summary is not None:
                summaries.append(summary)
                start = end
        call.body, replaced = continued_request(body, summaries)
        call.compact = False
        call.compaction = Compaction(summary="\n\n".join(summaries), replaced_messages=replaced,
                                     usage=summed_usage(calls), message=summary_note(summaries), calls=calls,
                                     compaction_ms=round((time.perf_counter() - started) * 1000, 1))
        return True

    async def _consolidated(self, call: Call, body: JSONObject, leading: int, summaries: list[str], budget: Budget,
                            calls: list[dict[str, Any]], cut: Cut | None) -> list[str]:
        """The summaries so far summarised again into one (a call that begins with the last one's prefix)."""
        summary = await self._summarise(call, body, leading, summaries, [], budget, calls, cut,
                                        self.settings.instruction)
        return [summary] if summary is not None else summaries

    async def _summarise(self, call: Call, body: JSONObject, leading: int, summaries: list[str],
                         piece: list[Any], budget: Budget, calls: list[dict[str, Any]], cut: Cut | None,
                         instruction: str | None = None) -> str | None:
        """One summary call. None when the upstream refused it as too long: the budget has learnt the
        upstream's numbers (or, where the refusal gives none, weighs messages a quarter heavier), and
        the caller cuts the piece again."""
        request = piece_request(body, leading, summaries, piece, self.settings, instruction)
        salt = tenant_salt(call.principal.tenant)
        estimated = budget.raw(request["messages"], request.get("tools"))
        try:
            result, route = await self.router.call(
                call.model, lambda b: b.post_json(call.path, request, salt=salt),
                blocks=cut(request) if cut is not None else (), salt=salt, path=call.path, prompt=request)
        except GatewayError as exc:
            if not is_context_overflow(exc) or call.refits >= MAX_REFITS:
                raise
            call.refits += 1
            overflow = self.windows.learn(exc.upstream, call.model, exc.message, estimated)
            if overflow.context_tokens is not None:
                budget.context_tokens = overflow.context_tokens
            ratio = self.windows.ratio(call.model)
            budget.ratio = ratio if ratio > budget.ratio else budget.ratio * 1.25
            return None
        self.router.release(route)
        usage, accounted = self.accountant.finish(route.backend.name, call.model, result.body.get("usage"),
                                                  route.matched_tokens)
        self.windows.observe(call.model, estimated, accounted.prompt_tokens)
        calls.append({**usage, "usage_source": accounted.source})
        return summary_text(result.body)
