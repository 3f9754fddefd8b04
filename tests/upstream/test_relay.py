"""The SSE relay: events pass through as they complete, usage is teed (or dropped, or rewritten),
and every way a stream can go wrong ends with an error event and a closed upstream."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson

from gateway.upstream.relay import StreamOutcome, relay_stream


class Stream:
    def __init__(self, *pieces: bytes) -> None:
        self.pieces = pieces
        self.closed = False

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece

    async def aclose(self) -> None:
        self.closed = True


def event(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


CHUNK = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
LAST = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
DONE = b"data: [DONE]\n\n"


async def relay(stream: Stream, **options: object) -> tuple[bytes, StreamOutcome]:
    outcome = StreamOutcome()
    outcome.chunks = []
    out = b"".join([part async for part in relay_stream(stream, outcome, **options)])  # type: ignore[arg-type]
    return out, outcome


async def test_events_split_across_reads_are_relayed_whole_and_usage_is_teed() -> None:
    whole = event(CHUNK) + event(LAST) + event(USAGE) + DONE
    stream = Stream(whole[:7], whole[7:40], whole[40:])
    out, outcome = await relay(stream, drop_usage_chunk=False)
    assert out == whole and stream.closed
    assert outcome.completed and outcome.finish_reason == "stop" and outcome.usage == USAGE["usage"]
    assert outcome.first_byte_s is not None and len(outcome.chunks or []) == 3


async def test_usage_chunk_dropped_or_rewritten() -> None:
    dropped, outcome = await relay(Stream(event(CHUNK), event(USAGE), DONE), drop_usage_chunk=True)
    assert dropped == event(CHUNK) + DONE and outcome.usage == USAGE["usage"]
    rewritten, _ = await relay(Stream(event(CHUNK), event(USAGE), DONE), drop_usage_chunk=False,
                               rewrite_usage_chunk=lambda c: {**c, "kvgate": 1})
    assert rewritten == event(CHUNK) + event({**USAGE, "kvgate": 1}) + DONE


async def test_usage_riding_on_the_last_choice_is_rewritten_and_kept() -> None:
    """llama.cpp's streamed completion: the last chunk carries `choices` and `usage` together."""
    last = {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}], "usage": USAGE["usage"]}
    for drop in (True, False):
        out, outcome = await relay(Stream(event(CHUNK), event(last), DONE), drop_usage_chunk=drop,
                                   rewrite_usage_chunk=lambda c: {**c, "kvgate": 1})
        assert out == event(CHUNK) + event({**last, "kvgate": 1}) + DONE
        assert outcome.usage == USAGE["usage"] and outcome.finish_reason == "stop"


async def test_garbage_and_early_close_end_with_an_error_event() -> None:
    for pieces in ((event(CHUNK), b"data: {not json\n\n"), (event(CHUNK), b"data: [1, 2]\n\n"), (event(CHUNK),)):
        stream = Stream(*pieces)
        out, outcome = await relay(stream, drop_usage_chunk=False)
        last = orjson.loads(out.rstrip(b"\n").split(b"\n\n")[-1][len(b"data: "):])
        assert out.startswith(event(CHUNK)) and last["error"]["type"] == "upstream_error"
        assert not outcome.completed and outcome.error is not None and stream.closed


async def test_upstream_error_event_is_passed_on_and_recorded() -> None:
    error = {"error": {"message": "overloaded", "type": "server_error"}}
    out, outcome = await relay(Stream(event(CHUNK), event(error)), drop_usage_chunk=False)
    assert out == event(CHUNK) + event(error) and outcome.error is not None and not outcome.completed
