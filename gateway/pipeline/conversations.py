"""Stateful Responses: a request's `previous_response_id` resolved from kvgate's store, and its
answer stored (`store: true`, OpenAI's default) with what a follow-up needs to continue it.

    chat-only upstream        the stored conversation (input and output items, never the
                              `instructions`) goes before the request's input, translated to chat
    Responses upstream        the request goes to the upstream that holds the conversation
                              (`Call.upstream`), under the id that upstream gave it

Answers a cache replayed, which no upstream holds, keep their items like a chat-only conversation,
so either kind of upstream continues them. Rows live in SQL (gateway/persistence/responses.py): a
follow-up may reach any replica, before or after a restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest
from gateway.persistence.responses import Item, ResponseRecord, ResponseStore
from gateway.schemas.responses_api import check_outputs_paired, input_items

STORED_STATUSES = frozenset({"completed", "incomplete"})


@dataclass(slots=True)
class Turn:
    """One Responses request with the conversation it continues resolved."""

    tenant: str
    body: dict[str, Any]
    input: list[Item]
    previous: ResponseRecord | None

    @property
    def store(self) -> bool:
        return self.body.get("store") is not False

    @property
    def history(self) -> list[Item]:
        """The stored items this request continues that its upstream does not hold."""
        return self.previous.items if self.previous is not None else []

    @property
    def upstream(self) -> str | None:
        """The upstream that holds the conversation, if one does."""
        return self.previous.upstream if self.previous is not None else None

    def chat_history(self) -> list[Item]:
        """The whole conversation before this input, for a chat-only upstream; InvalidRequest when an
        upstream that speaks the Responses API holds part of it."""
        if self.previous is not None and self.previous.upstream_response_id is not None:
            raise InvalidRequest(f"previous_response_id: that conversation is held by upstream "
                                 f"{self.previous.upstream!r}, which does not serve this model's Responses "
                                 f"requests now", param="previous_response_id")
        return self.history

    def native_body(self) -> dict[str, Any]:
        """The body for an upstream that speaks the Responses API: `previous_response_id` becomes
        the id that upstream knows (none when it holds nothing), and the items it does not hold go
        before the input. Unchanged when neither applies."""
        if self.previous is None:
            return self.body
        body = dict(self.body)
        if self.previous.upstream_response_id is None:
            body.pop("previous_response_id", None)
        else:
            body["previous_response_id"] = self.previous.upstream_response_id
        if self.history:
            body["input"] = [*self.history, *self.input]
        return body

    def record(self, response: dict[str, Any], upstream: str | None) -> ResponseRecord:
        """What to store of `response`; `upstream`, the one that answered and now holds it (None: the
        translated path, or a cache replay)."""
        previous = self.previous
        held_by: str | None
        held_id: str | None
        if upstream is not None:
            held_by, held_id, items = upstream, str(response["id"]), []
        else:
            held_by = previous.upstream if previous is not None else None
            held_id = previous.upstream_response_id if previous is not None else None
            items = [*self.history, *self.input, *response.get("output", [])]
        return ResponseRecord(tenant=self.tenant, id=str(response["id"]), model=str(self.body.get("model")),
                              response=response, input=self.input, items=items,
                              previous_response_id=previous.id if previous is not None else None,
                              upstream=held_by, upstream_response_id=held_id)


class Conversations:
    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def begin(self, tenant: str, body: dict[str, Any]) -> Turn:
        """The request as a `Turn`; 400 when its `previous_response_id` is not one of the
        tenant's unexpired stored responses."""
        # An upstream that speaks the API may take a request without input (a stored prompt).
        items = input_items(body["input"]) if body.get("input") not in (None, []) else []
        previous_id = body.get("previous_response_id")
        if not previous_id:
            return Turn(tenant, body, items, None)
        previous = await self.store.get(tenant, str(previous_id))
        if previous is None:
            # 400, as OpenAI answers it (a GET of the same id is 404).
            raise InvalidRequest(f"Previous response with id {previous_id!r} not found.",
                                 param="previous_response_id", code="previous_response_not_found")
        if previous.upstream_response_id is None:  # kvgate holds the whole conversation: check it here
            check_outputs_paired(previous.items, items)
        return Turn(tenant, body, items, previous)

    async def keep(self, turn: Turn, response: dict[str, Any], upstream: str | None = None) -> None:
        """Store a finished answer, unless its request said `store: false`."""
        if turn.store and response.get("status") in STORED_STATUSES and response.get("id"):
            await self.store.save(turn.record(response, upstream))
