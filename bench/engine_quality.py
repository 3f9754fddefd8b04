"""Greedy agreement and next-token KL of a weight format against the float32 reference.

Prompts: the first `num_prompts` questions of `bench/data/squad2_dev_5articles.jsonl.gz`, each
as one user message through the chat template. The reference is the float32 lean forward pass
(the same logits as transformers' float32 forward: checked by `tests/engine/test_lean.py`),
greedy, `new_tokens` tokens or until an end-of-sequence token.

- `greedy_agreement`: the share of prompts whose greedy continuation in the format is the
  reference's, token for token (same tokens, same length). Measured teacher-forced: the format
  reads the reference's continuation one token per step (the decode path, int4 kernel included)
  and must pick the reference's next token at every position; by induction that is exactly
  "its own greedy continuation equals the reference's".
- `token_agreement`: the share of all those positions where it picks the reference's token.
- `next_token_kl`: mean over those positions of KL(reference || format) of the next-token
  distribution, in nats.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import torch

from gateway.engine.kvpool import KVPool
from gateway.engine.lean import Feed, LeanModel
from gateway.engine.model import LoadedModel

DATA = Path(__file__).parent / "data" / "squad2_dev_5articles.jsonl.gz"
BATCH = 16  # sequences decoded together (below the dense float32 threshold of `quant.py`)


def prompts(loaded: LoadedModel, num_prompts: int) -> list[list[int]]:
    questions: list[str] = []
    with gzip.open(DATA, "rt") as f:
        for line in f:
            questions += [qa["question"] for qa in json.loads(line)["qas"]]
            if len(questions) >= num_prompts:
                break
    out = []
    for question in questions[:num_prompts]:
        ids = loaded.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _pool(loaded: LoadedModel) -> KVPool:
    return KVPool(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.dtype, loaded.device,
                  num_slots=BATCH)


def _run(lean: LeanModel, loaded: LoadedModel, batch: list[list[int]], forced: list[list[int]] | None,
         new_tokens: int, together: bool = True) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy (forced None) or teacher-forced decode of a batch, its sequences stepped together
    or one at a time; returns the tokens fed and each one's log-probabilities `[n, vocab]`."""
    pool = _pool(loaded)
    slots = [pool.allocate() for _ in batch]
    logits = torch.stack([lean.forward(pool, [Feed(s, 0, ids)])[0] for s, ids in zip(slots, batch, strict=True)])
    tokens: list[list[int]] = [[] for _ in batch]
    logps: list[list[torch.Tensor]] = [[] for _ in batch]
    live = list(range(len(batch)))
    eos = set(loaded.eos_token_ids)
    for step in range(new_tokens):
        for row, i in enumerate(live):
            logps[i].append(torch.log_softmax(logits[row].float(), dim=-1))
            token = int(logits[row].argmax()) if forced is None else forced[i][step]
            tokens[i].append(token)
        limit = [len(forced[i]) for i in live] if forced is not None else [new_tokens] * len(live)
        live = [i for i, n in zip(live, limit, strict=True)
                if tokens[i][-1] not in eos and len(tokens[i]) < n]
        if not live:
            break
        feeds = [Feed(slots[i], len(batch[i]) + len(tokens[i]) - 1, [tokens[i][-1]]) for i in live]
        logits = lean.forward(pool, feeds) if together else torch.cat([lean.forward(pool, [f]) for f in feeds])
    return tokens, [torch.stack(rows) for rows in logps]


def agreement(loaded: LoadedModel, weights: str, *, num_prompts: int = 50, new_tokens: int = 32) -> dict[str, Any]:
    """The figures above for one sequence decoding alone (`greedy_agreement`, ...) and for 16
    decoding together (`batched_*`: their rows share each matrix product, and past a few rows
    the format may use another kernel, see `quant.py`)."""
    ref = LeanModel(loaded.model, "float32")
    lean = LeanModel(loaded.model, weights)
    all_prompts = prompts(loaded, num_prompts)
    out: dict[str, Any] = {"weights": weights, "prompts": len(all_prompts), "new_tokens": new_tokens}
    references = []
    for at in range(0, len(all_prompts), BATCH):
        batch = all_prompts[at : at + BATCH]
        references.append((batch, *_run(ref, loaded, batch, None, new_tokens)))
    for prefix, together in (("", False), ("batched_", True)):
        agree = positions = matched = 0
        kl_sum = 0.0
        for batch, ref_tokens, ref_logps in references:
            _, logps = _run(lean, loaded, batch, ref_tokens, new_tokens, together)
            for want, p, q in zip(ref_tokens, ref_logps, logps, strict=True):
                hits = sum(1 for a, b in zip(q.argmax(dim=-1).tolist(), want, strict=True) if a == b)
                agree += hits == len(want)
                matched += hits
                positions += len(want)
                kl_sum += float((p.exp() * (p - q)).sum())
        out |= {f"{prefix}greedy_agreement": round(agree / len(all_prompts), 3),
                f"{prefix}token_agreement": round(matched / positions, 4),
                f"{prefix}next_token_kl": round(kl_sum / positions, 6)}
    return out
