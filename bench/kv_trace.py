"""`kvgate bench kv-trace`: replay a prefix-block trace through the manager, metadata only.

For each eviction policy and capacity, one tier of that many blocks: prefix hit ratio next to
Belady's offline optimum at the same capacity (exact when the trace is chained, see
`gateway.kvcache.trace.belady_hit_ratio`) and the unbounded ideal. Then the tier stack given
by --device-blocks/--host-blocks/--disk-blocks: the share of blocks each tier served.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from gateway.kvcache.factory import build_metadata_manager
from gateway.kvcache.keys import block_hash_from_id
from gateway.kvcache.settings import EvictionPolicyName, KVCacheSettings, WritePolicy
from gateway.kvcache.trace import TraceRequest, belady_hit_ratio, ideal_hit_ratio, is_chained, read_trace

DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared/data/mooncake/conversation_trace.jsonl"


def replay(trace: list[TraceRequest], tiers: list[tuple[str, int | None]], policy: str,
           write_policy: WritePolicy = WritePolicy.WRITE_THROUGH, block_size: int = 512) -> dict[str, float]:
    """Prefix hit ratio overall and per tier (share of all prompt blocks served by that tier)."""
    settings = KVCacheSettings(block_size=block_size, eviction_policy=EvictionPolicyName(policy),
                               write_policy=write_policy)
    manager = build_metadata_manager(tiers, block_size=block_size, settings=settings)
    per_tier = dict.fromkeys(manager.tier_names, 0)
    total = 0
    for r in trace:
        hashes = [block_hash_from_id(b) for b in r.hash_ids]
        result = manager.lookup_hashes(hashes)
        for name in result.tiers:
            per_tier[name] += 1
        manager.load(result)
        manager.store_hashes(hashes)
        total += len(hashes)
    out = {f"{name}_hit_ratio": n / total for name, n in per_tier.items()}
    out["hit_ratio"] = sum(per_tier.values()) / total
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvgate bench kv-trace", description=__doc__)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--capacities", default="2000,4000,8000,16000,32000",
                   help="comma-separated single-tier capacities in blocks")
    p.add_argument("--policies", default=",".join(EvictionPolicyName))
    p.add_argument("--device-blocks", type=int, default=2000)
    p.add_argument("--host-blocks", type=int, default=8000)
    p.add_argument("--disk-blocks", type=int, default=32000)
    p.add_argument("--block-size", type=int, default=512, help="tokens per block of the trace")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    start = time.perf_counter()
    trace = read_trace(args.trace)
    capacities = [int(c) for c in args.capacities.split(",") if c]
    policies = [x for x in args.policies.split(",") if x]
    rows = []
    for cap in capacities:
        belady = belady_hit_ratio(trace, cap)
        for policy in policies:
            r = replay(trace, [("cache", cap)], policy, block_size=args.block_size)
            rows.append({"policy": policy, "capacity_blocks": cap, "hit_ratio": round(r["hit_ratio"], 4),
                         "belady_hit_ratio": round(belady, 4),
                         "of_belady": round(r["hit_ratio"] / belady, 3) if belady else None})
    stack = [("device", args.device_blocks), ("host", args.host_blocks), ("disk", args.disk_blocks)]
    tier_rows = []
    for policy in policies:
        r = replay(trace, stack, policy, block_size=args.block_size)
        tier_rows.append({"policy": policy, **{k: round(v, 4) for k, v in r.items()}})
    result = {
        "trace": str(args.trace), "num_requests": len(trace),
        "num_blocks": sum(len(r.hash_ids) for r in trace),
        "ideal_hit_ratio": round(ideal_hit_ratio(trace), 4), "belady_exact": is_chained(trace), "rows": rows,
        "tier_stack": {"capacity_blocks": dict(stack), "rows": tier_rows},
        "elapsed_s": round(time.perf_counter() - start, 1),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"trace {result['trace']}: {result['num_requests']} requests, {result['num_blocks']} blocks, "
          f"ideal (unbounded) prefix hit ratio {result['ideal_hit_ratio']}, "
          f"belady {'exact (chained trace)' if result['belady_exact'] else 'reference only (trace not chained)'}")
    print(f"{'policy':8} {'capacity':>9} {'hit_ratio':>9} {'belady':>7} {'of_belady':>9}")
    for row in rows:
        print(f"{row['policy']:8} {row['capacity_blocks']:>9} {row['hit_ratio']:>9.4f} "
              f"{row['belady_hit_ratio']:>7.4f} {row['of_belady']:>9}")
    print(f"tier stack {dict(stack)} (share of all blocks served per tier):")
    for row in tier_rows:
        print("  " + "  ".join(f"{k}={v}" for k, v in row.items()))
    print(f"elapsed {result['elapsed_s']} s")
    return 0
