"""OpenAI's Responses API: `POST /v1/responses` forwarded unchanged to upstreams that speak it
(`"responses_api": true`), translated to chat completions for the others (the built-in engine
included), through the same caches, single-flight and accounting as `/v1/chat/completions`. JSON
and SSE, in the event types the openai SDK parses.

Stateful like OpenAI's: an answer is stored unless its request says `store: false`, and
`previous_response_id` continues it (gateway/pipeline/conversations.py); `GET` and `DELETE
/v1/responses/{id}` and `GET /v1/responses/{id}/input_items` read and delete stored answers.
Every stored answer belongs to the tenant whose key made it: for another, it does not exist.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from gateway.api.body import read_json
from gateway.api.deps import AdmittedDep, PrincipalDep, ServicesDep
from gateway.api.messages import speaks
from gateway.api.openai import request_id
from gateway.api.render import render
from gateway.api.translate import close_source, translate_json, translate_stream
from gateway.canonical.prompt_cache import with_prompt_cache_key
from gateway.errors import GatewayError, InvalidField, NotFound
from gateway.persistence.keys import Principal
from gateway.persistence.responses import ResponseRecord
from gateway.pipeline.call import Call, Route
from gateway.pipeline.compaction import opted_in, truncation_chosen
from gateway.pipeline.results import Answer, EventStream, Result
from gateway.responsecache.controls import read_controls
from gateway.schemas import responses_api
from gateway.services import Services

router = APIRouter(prefix="/v1")
Keep = Callable[[dict[str, Any]], Awaitable[None]]


@router.post("/responses")
async def responses(request: Request, services: ServicesDep, principal: AdmittedDep) -> Response:
    body = await read_json(request, services.settings.max_body_bytes)
    controls = read_controls(request.headers, body)
    compact = opted_in(request.headers, body)
    truncate = truncation_chosen(request.headers, body, responses=True)
    session = request.headers.get("x-kvgate-session")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidField("model: required", param="model")
    conversations = services.conversations
    turn = await conversations.begin(principal.tenant, body)
    stream = bool(body.get("stream"))

    async def keep(answer: dict[str, Any], upstream: str | None = None) -> None:
        await conversations.keep(turn, answer, upstream)

    if services.native_responses is not None and await speaks(services, model, "responses_api", True):
        native = Call(request_id(request), principal, Route.RESPONSES, "/responses", model,
                      with_prompt_cache_key(turn.native_body(), principal.tenant, session,
                                            derive=services.settings.derive_prompt_cache_key),
                      stream=stream, cache=controls, session=session, upstream=turn.upstream,
                      on_answer=keep if turn.store else None)
        return render(await services.native_responses.forward(native))
    chat = with_prompt_cache_key(responses_api.to_chat_request(body, turn.chat_history()), principal.tenant,
                                 session, derive=services.settings.derive_prompt_cache_key)
    call = Call(request_id(request), principal, Route.RESPONSES, "/chat/completions", model, chat, stream=stream,
                include_usage=True, cache=controls, session=session, truncate=truncate,
                compact=compact if compact is not None else principal.tenant in services.settings.compaction.tenants)
    response = await services.proxy.forward(call)
    if stream:
        translator = responses_api.ChatToResponsesStream(body, model)
        translated = translate_stream(response, translator, translator.error)
        return render(_kept(translated, translator, keep) if turn.store else translated)
    answer = translate_json(response, lambda completion: responses_api.from_chat_completion(completion, body))
    if turn.store:
        await keep(orjson.loads(answer.body))
    return render(answer)


def _kept(result: EventStream, translator: responses_api.ChatToResponsesStream, keep: Keep) -> EventStream:
    """The translated stream, its answer stored before the client reads the last event: a follow-up
    sent the moment the client has the answer finds it, on any replica. A stream that fails or is
    cut off is never stored; a store that fails ends the stream with an error event instead."""
    source = result.events

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in source:
                if translator.finished:
                    try:
                        await keep(translator.response)
                    except GatewayError as exc:
                        yield translator.error(exc.envelope())
                        return
                yield chunk
        finally:
            await close_source(source)

    return EventStream(events(), result.headers, result.finish)


async def _stored(services: Services, principal: Principal, response_id: str) -> ResponseRecord:
    record = await services.conversations.store.get(principal.tenant, response_id)
    if record is None:
        raise _not_found(response_id)
    return record


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id {response_id!r} not found.", param="response_id", code="response_not_found")


def _json(payload: dict[str, Any]) -> Response:
    answer: Result = Answer(orjson.dumps(payload))
    return render(answer)


@router.get("/responses/{response_id}")
async def get_response(response_id: str, services: ServicesDep, principal: PrincipalDep) -> Response:
    return _json((await _stored(services, principal, response_id)).response)


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, services: ServicesDep, principal: PrincipalDep) -> Response:
    if not await services.conversations.store.delete(principal.tenant, response_id):
        raise _not_found(response_id)
    return _json({"id": response_id, "object": "response", "deleted": True})


@router.get("/responses/{response_id}/input_items")
async def list_input_items(response_id: str, services: ServicesDep, principal: PrincipalDep,
                      limit: int = Query(20, ge=1, le=100), order: Literal["asc", "desc"] = "desc",
                      after: str | None = None) -> Response:
    """The input items of the request that made the answer (not those of the answers before it)."""
    record = await _stored(services, principal, response_id)
    items = [responses_api.listed_item(item, f"item_{i}_{record.id}") for i, item in enumerate(record.input)]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return _json({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                  "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
