"""The engine is wrapped at its boundary like the HTTP client (issue 14): a failure inside the real
engine reaches the proxy as an EngineError (OpenAI 500, a request-log row), and mid-stream as an
error event, never as a bare exception or a cut stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gateway.engine.runner import ModelRunner
from gateway.engine.scheduler import BatchScheduler, EngineWorker
from gateway.engine.settings import EngineSettings
from gateway.errors import EngineError
from gateway.upstream.engine import COMPLETIONS, EngineBackend
from gateway.upstream.relay import StreamOutcome, relay_stream

BODY = {"model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 4}


@pytest.fixture
def failing_backend(make_runner: Callable[..., ModelRunner], monkeypatch: pytest.MonkeyPatch) -> Any:
    runner = make_runner()

    def step(*_: Any, **__: Any) -> None:
        raise RuntimeError("CUDA out of memory (simulated inside the real runner)")

    monkeypatch.setattr(runner, "step", step)
    scheduler = BatchScheduler(runner, max_batch=4, prefill_chunk_tokens=256)
    worker = EngineWorker(runner, scheduler, max_queue=8)
    yield EngineBackend(worker, EngineSettings())
    scheduler.close()


async def test_a_failing_engine_raises_engine_error(failing_backend: EngineBackend) -> None:
    with pytest.raises(EngineError) as info:
        await failing_backend.post_json(COMPLETIONS, BODY)
    assert info.value.status_code == 500
    assert info.value.envelope()["error"]["code"] == "engine_error"
    assert isinstance(info.value.__cause__, RuntimeError)


async def test_a_failing_engine_stream_ends_with_an_error_event(failing_backend: EngineBackend) -> None:
    stream = await failing_backend.post_stream(COMPLETIONS, {**BODY, "stream": True})
    outcome = StreamOutcome(started_s=0.0)
    events = [event async for event in relay_stream(stream, outcome, drop_usage_chunk=False)]
    assert isinstance(outcome.error, EngineError)
    assert b'"engine_error"' in events[-1]
