"""Anthropic's Messages API (`POST /v1/messages`): the anthropic SDK pointed at kvgate works.

Anthropic-style upstreams get the body unchanged (gateway/pipeline/native.py); OpenAI-style
upstreams and the built-in engine get it translated to chat completions, through the same caches,
single-flight and accounting as `/v1/chat/completions`. The SDK's `x-api-key` authenticates (see
api/auth.py); `anthropic-version` is accepted and not needed; `anthropic-beta` reaches Anthropic-style
upstreams (and is part of the cache key there), and is dropped when the request is translated. Errors on
this route are in Anthropic's envelope (errors.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.body import read_json
from gateway.api.deps import AdmittedDep, ServicesDep
from gateway.api.openai import request_id
from gateway.api.render import render
from gateway.api.translate import translate_json, translate_stream
from gateway.canonical.prompt_cache import with_prompt_cache_key
from gateway.pipeline.call import Call, Route
from gateway.responsecache.controls import read_controls
from gateway.schemas import anthropic
from gateway.schemas.usage import error_of
from gateway.services import Services
from gateway.usage.tokens import estimate_prompt_tokens

router = APIRouter(prefix="/v1")


async def speaks(services: Services, model: str, setting: str, value: object) -> bool:
    """Whether every upstream of the model has `setting == value` (it takes the API as is);
    when only some do, requests are translated, which every upstream understands."""
    backends = await services.router.serving(model)
    return all(getattr(getattr(b, "config", None), setting, None) == value for b in backends)


def _stream_error(envelope: dict[str, Any]) -> bytes:
    error = error_of(envelope)
    return anthropic.error_event(502, str(error.get("message") or "upstream error"))


@router.post("/messages")
async def messages(request: Request, services: ServicesDep, principal: AdmittedDep) -> Response:
    body = await read_json(request, services.settings.max_body_bytes)
    controls = read_controls(request.headers, body)
    anthropic.check_required(body)
    model, stream = body["model"], bool(body.get("stream"))
    session = request.headers.get("x-kvgate-session")
    if services.native_messages is not None and await speaks(services, model, "api", "anthropic"):
        beta = request.headers.get("anthropic-beta")
        call = Call(request_id(request), principal, Route.MESSAGES, "/messages", model, body, stream=stream,
                    cache=controls, session=session, upstream_headers={"anthropic-beta": beta} if beta else {})
        return render(await services.native_messages.forward(call))
    chat = with_prompt_cache_key(anthropic.to_chat_request(body), principal.tenant, session,
                                 derive=services.settings.derive_prompt_cache_key)
    call = Call(request_id(request), principal, Route.MESSAGES, "/chat/completions", model, chat, stream=stream,
                include_usage=True, cache=controls, session=session)
    response = await services.proxy.forward(call)
    if stream:
        hit = response.headers.get("x-kvgate-cache", "").startswith("hit")
        translator = anthropic.ChatToAnthropicStream(model, input_tokens=estimate_prompt_tokens(chat), cached=hit)
        return render(translate_stream(response, translator, _stream_error))
    return render(translate_json(response, lambda completion: anthropic.from_chat_completion(completion, model)))
