"""OpenAI's Responses API (`POST /v1/responses`): forwarded unchanged to upstreams that speak it
(`"responses_api": true`), translated to chat completions for the others (the built-in engine
included), through the same caches, single-flight and accounting as `/v1/chat/completions`. JSON
and SSE, in the event types the openai SDK parses."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.body import read_json
from gateway.api.deps import AdmittedDep, ServicesDep
from gateway.api.messages import speaks
from gateway.api.openai import request_id
from gateway.api.render import render
from gateway.api.translate import translate_json, translate_stream
from gateway.canonical.prompt_cache import with_prompt_cache_key
from gateway.errors import InvalidField
from gateway.pipeline.call import Call, Route
from gateway.responsecache.controls import read_controls
from gateway.schemas import responses_api

router = APIRouter(prefix="/v1")


@router.post("/responses")
async def responses(request: Request, services: ServicesDep, principal: AdmittedDep) -> Response:
    body = await read_json(request, services.settings.max_body_bytes)
    controls = read_controls(request.headers, body)
    session = request.headers.get("x-kvgate-session")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidField("model: required", param="model")
    if services.native_responses is not None and await speaks(services, model, "responses_api", True):
        native = Call(request_id(request), principal, Route.RESPONSES, "/responses", model,
                      with_prompt_cache_key(body, principal.tenant, session,
                                            derive=services.settings.derive_prompt_cache_key),
                      stream=bool(body.get("stream")), cache=controls, session=session)
        return render(await services.native_responses.forward(native))
    chat = with_prompt_cache_key(responses_api.to_chat_request(body), principal.tenant, session,
                                 derive=services.settings.derive_prompt_cache_key)
    stream = bool(body.get("stream"))
    call = Call(request_id(request), principal, Route.RESPONSES, "/chat/completions", model, chat, stream=stream,
                include_usage=True, cache=controls, session=session)
    response = await services.proxy.forward(call)
    if stream:
        translator = responses_api.ChatToResponsesStream(body, model)
        return render(translate_stream(response, translator, translator.error))

    def convert(completion: dict[str, Any]) -> dict[str, Any]:
        return responses_api.from_chat_completion(completion, body)

    return render(translate_json(response, convert))
