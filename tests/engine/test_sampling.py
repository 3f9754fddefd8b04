"""Sampling parameters on the real model: seeds reproduce, stop strings cut, max_tokens says length."""

from __future__ import annotations

from gateway.engine.model import LoadedModel
from gateway.engine.runner import Generation, ModelRunner
from gateway.engine.sampling import SamplingParams, TextStream
from tests.engine.test_restore import prompt_ids


def run(loaded: LoadedModel, params: SamplingParams,
        text: str = "Write one sentence about the sea.") -> tuple[str, str]:
    runner = ModelRunner(loaded, None, layerwise_min_tokens=1 << 30)
    pieces: list[str] = []
    try:
        result = runner.run(Generation(prompt_ids(loaded, text), params, on_text=pieces.append))
    finally:
        runner.close()
    assert "".join(pieces) == result.text, "the streamed pieces add up to the answer"
    return result.text, result.finish_reason


def test_seed_reproduces_and_temperature_varies(loaded_model: LoadedModel) -> None:
    a = run(loaded_model, SamplingParams(max_tokens=12, temperature=1.2, seed=7))
    b = run(loaded_model, SamplingParams(max_tokens=12, temperature=1.2, seed=7))
    others = {run(loaded_model, SamplingParams(max_tokens=12, temperature=1.2, seed=s))[0] for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a[0]}) > 1


def test_max_tokens_and_stop(loaded_model: LoadedModel) -> None:
    text, reason = run(loaded_model, SamplingParams(max_tokens=3))
    assert reason == "length" and text
    full, _ = run(loaded_model, SamplingParams(max_tokens=30), "What is the capital of France?")
    assert "Paris" in full
    cut, reason = run(loaded_model, SamplingParams(max_tokens=30, stop=["Paris"]), "What is the capital of France?")
    assert reason == "stop" and cut == full[: full.index("Paris")]


def test_text_stream_holds_back_a_possible_stop_prefix(loaded_model: LoadedModel) -> None:
    tokenizer = loaded_model.tokenizer
    ids = tokenizer("Hello END of story")["input_ids"]  # type: ignore[operator]
    stream = TextStream(tokenizer, ["END"])
    released = "".join(stream.push(t) for t in ids)
    assert stream.stopped and released == "Hello " and "END" not in released
