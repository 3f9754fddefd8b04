"""Continuous batching on the real model: sequences that share forward passes, restored from the KV
tiers, stored through the write-behind queue and prefetched between turns, answer exactly as a
cold single-request run does; each streams on its own; a cancelled one frees its slot at once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.engine.model import LoadedModel
from gateway.engine.runner import Generation, GenerationResult, ModelRunner
from gateway.engine.sampling import SamplingParams
from gateway.engine.scheduler import BatchScheduler
from gateway.engine.service import attach_planner
from gateway.kvcache.prefetch import PrefetchPlanner
from gateway.kvcache.writebehind import WriteBehindQueue
from tests.engine.test_restore import prompt_ids

QUESTIONS = [
    "Name three primary colours.",
    "You are a geography tutor. Answer in one short sentence. What is the capital city of France?",
    "Write one sentence about the sea and the wind, for a child who has never seen either of them.",
    "What is two plus two? Explain briefly.",
]


def chat_ids(loaded: LoadedModel, messages: list[dict[str, str]]) -> list[int]:
    rendered = loaded.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        messages, add_generation_prompt=True, tokenize=True
    )
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def cold_run(loaded: LoadedModel, ids: list[int], max_tokens: int) -> GenerationResult:
    runner = ModelRunner(loaded, None, layerwise_min_tokens=1 << 30)
    try:
        return runner.run(Generation(ids, SamplingParams(max_tokens=max_tokens)))
    finally:
        runner.close()


@pytest.fixture
def batched(loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner],
            tmp_path: Path) -> Iterator[tuple[BatchScheduler, WriteBehindQueue, PrefetchPlanner]]:
    # A host tier too small for all four conversations: next turns restore from host and disk,
    # with blocks the prefetcher brought back between the turns.
    block = loaded_model.kv_bytes_per_token * 16
    runner = make_runner(host_capacity_bytes=24 * block, disk_capacity_bytes=1 << 30, disk_dir=tmp_path,
                         skip_slow_tiers=False)
    assert runner.kv is not None
    writer = WriteBehindQueue(runner.kv, max_pending_blocks=4096)
    runner.writer = writer
    scheduler = BatchScheduler(runner, max_batch=8, prefill_chunk_tokens=24)
    planner = PrefetchPlanner(runner.kv, budget_bytes=12 * block, lead_s=0.0, first_gap_s=0.0)
    attach_planner(scheduler, planner)
    yield scheduler, writer, planner
    scheduler.close()
    planner.close()
    writer.close()


def test_batched_restored_turns_answer_as_cold_single_runs(
    loaded_model: LoadedModel, batched: tuple[BatchScheduler, WriteBehindQueue, PrefetchPlanner]
) -> None:
    scheduler, writer, planner = batched
    max_tokens = 16
    first_turns = [[{"role": "user", "content": q}] for q in QUESTIONS]
    pieces: list[list[str]] = [[] for _ in QUESTIONS]
    futures = [scheduler.submit(Generation(chat_ids(loaded_model, m), SamplingParams(max_tokens=max_tokens),
                                           salt="t", on_text=pieces[i].append))
               for i, m in enumerate(first_turns)]
    results = [f.result(timeout=600) for f in futures]
    assert scheduler.stats.max_running > 1, "the sequences never shared a step"
    for i, (messages, result) in enumerate(zip(first_turns, results, strict=True)):
        assert result.text == cold_run(loaded_model, chat_ids(loaded_model, messages), max_tokens).text
        assert "".join(pieces[i]) == result.text, "each sequence streams its own text"
    assert writer.flush(timeout_s=120)

    # Second turns: the first turn (prompt and answer) comes back from the tiers, batched again.
    second_turns = [[*m, {"role": "assistant", "content": r.text}, {"role": "user", "content": "Say it again."}]
                    for m, r in zip(first_turns, results, strict=True)]
    futures = [scheduler.submit(Generation(chat_ids(loaded_model, m), SamplingParams(max_tokens=max_tokens),
                                           salt="t")) for m in second_turns]
    again = [f.result(timeout=600) for f in futures]
    for messages, result in zip(second_turns, again, strict=True):
        assert result.cached_tokens > 0, "the second turn was not restored"
        assert result.text == cold_run(loaded_model, chat_ids(loaded_model, messages), max_tokens).text
    assert planner.stats.num_turns_ended == 8
    assert planner.stats.num_prefetches > 0


def test_a_cancelled_sequence_frees_its_slot(
    loaded_model: LoadedModel, make_runner: Callable[..., ModelRunner]
) -> None:
    runner = make_runner()
    scheduler = BatchScheduler(runner, max_batch=1, prefill_chunk_tokens=64)
    try:
        long = Generation(prompt_ids(loaded_model, QUESTIONS[2]), SamplingParams(max_tokens=400))
        seen = threading.Event()

        def cancel_after_first(_piece: str) -> None:
            seen.set()
            long.cancelled.set()

        long.on_text = cancel_after_first
        first = scheduler.submit(long)
        second = scheduler.submit(Generation(prompt_ids(loaded_model, QUESTIONS[0]), SamplingParams(max_tokens=8)))
        done = second.result(timeout=600)
        cancelled = first.result(timeout=60)
        assert seen.is_set()
        assert cancelled.completion_tokens < 400
        assert done.completion_tokens > 0
        assert done.text == cold_run(loaded_model, prompt_ids(loaded_model, QUESTIONS[0]), 8).text
    finally:
        scheduler.close()
