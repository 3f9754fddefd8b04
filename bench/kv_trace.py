"""`kvgate bench kv-trace`: replay a prefix-block trace through the manager, metadata only.

For each eviction policy, admission policy and capacity, one tier of that many blocks: prefix hit
ratio next to Belady's offline optimum at the same capacity (exact when the trace is chained, see
`gateway.kvcache.trace.belady_hit_ratio`) and the unbounded ideal; a row is named `policy` with
every block admitted, `policy+admission` otherwise. Then the tier stack given by
--device-blocks/--host-blocks/--disk-blocks under each of --stack-admissions: the share of blocks
each tier served and the blocks written to it.

--part first-half / second-half replays one half of the requests (split by count, both from a cold
cache): tune on the first, check on the second.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

from gateway.kvcache.factory import build_metadata_manager
from gateway.kvcache.keys import block_hash_from_id
from gateway.kvcache.settings import AdmissionName, EvictionPolicyName, KVCacheSettings, WritePolicy
from gateway.kvcache.trace import TraceRequest, belady_hit_ratio, ideal_hit_ratio, is_chained, read_trace

DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared/data/mooncake/conversation_trace.jsonl"
DEFAULT_STACK_ADMISSIONS = "always/always/always;auto/auto/auto;always/always/second-hit"


def replay(trace: list[TraceRequest], tiers: list[tuple[str, int | None]], policy: str,
           write_policy: WritePolicy = WritePolicy.WRITE_THROUGH, block_size: int = 512,
           admission: str | Sequence[str] = AdmissionName.ALWAYS) -> dict[str, float]:
    """Prefix hit ratio overall and per tier (share of all prompt blocks served by that tier), and
    the blocks written to each tier per prompt block."""
    settings = KVCacheSettings(block_size=block_size, eviction_policy=EvictionPolicyName(policy),
                               write_policy=write_policy)
    names = AdmissionName(admission) if isinstance(admission, str) else [AdmissionName(a) for a in admission]
    manager = build_metadata_manager(tiers, block_size=block_size, settings=settings, admission=names)
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
    for t in manager.stats().tiers:
        out[f"{t.name}_writes_per_block"] = t.bytes_in / total  # metadata tiers store 1 byte a block
    return out


def label(policy: str, admission: str) -> str:
    return policy if admission == AdmissionName.ALWAYS else f"{policy}+{admission}"


def part_of(trace: list[TraceRequest], part: str) -> list[TraceRequest]:
    half = len(trace) // 2
    return {"all": trace, "first-half": trace[:half], "second-half": trace[half:]}[part]


def _print(result: dict, rows: list[dict], tier_rows: list[dict], best: list[dict]) -> None:
    print(f"trace {result['trace']} ({result['part']}): {result['num_requests']} requests, "
          f"{result['num_blocks']} blocks, ideal (unbounded) prefix hit ratio {result['ideal_hit_ratio']}, "
          f"belady {'exact (chained trace)' if result['belady_exact'] else 'reference only (trace not chained)'}")
    width = max(len(r["policy"]) for r in rows) if rows else 6
    print(f"{'policy':{width}} {'capacity':>9} {'hit_ratio':>9} {'belady':>7} {'of_belady':>9}")
    for row in rows:
        print(f"{row['policy']:{width}} {row['capacity_blocks']:>9} {row['hit_ratio']:>9.4f} "
              f"{row['belady_hit_ratio']:>7.4f} {row['of_belady']!s:>9}")
    print("best per capacity (of Belady); Belady refusing every first sighting (second-hit's bound):")
    for b, bound in zip(best, result["second_hit_bound"], strict=True):
        print(f"  {b['capacity_blocks']:>6}: {b['policy']} {b['of_belady']}; "
              f"{bound['belady_second_hit_only']} = {bound['of_belady']} of Belady")
    print(f"tier stack {result['tier_stack']['capacity_blocks']} (share of all blocks served per tier, "
          "blocks written per prompt block):")
    for row in tier_rows:
        print("  " + "  ".join(f"{k}={v}" for k, v in row.items()))
    print(f"elapsed {result['elapsed_s']} s")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvgate bench kv-trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--part", choices=["all", "first-half", "second-half"], default="all")
    p.add_argument("--capacities", default="2000,4000,8000,16000,32000",
                   help="comma-separated single-tier capacities in blocks")
    p.add_argument("--policies", default=",".join(EvictionPolicyName))
    p.add_argument("--admissions", default=",".join(a for a in AdmissionName if a != AdmissionName.AUTO),
                   help="admission policies of the single-tier rows (auto is always in a single tier)")
    p.add_argument("--device-blocks", type=int, default=2000)
    p.add_argument("--host-blocks", type=int, default=8000)
    p.add_argument("--disk-blocks", type=int, default=32000, help="0 leaves a tier out of the stack")
    p.add_argument("--stack-admissions", default=DEFAULT_STACK_ADMISSIONS,
                   help="';'-separated device/host/disk admission triples for the tier stack")
    p.add_argument("--block-size", type=int, default=512, help="tokens per block of the trace")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    start = time.perf_counter()
    trace = part_of(read_trace(args.trace), args.part)
    capacities = [int(c) for c in args.capacities.split(",") if c]
    policies = [x for x in args.policies.split(",") if x]
    admissions = [AdmissionName(x) for x in args.admissions.split(",") if x]
    rows = []
    bounds = []
    for cap in capacities:
        belady = belady_hit_ratio(trace, cap)
        second_hit = belady_hit_ratio(trace, cap, second_hit_only=True)
        bounds.append({"capacity_blocks": cap, "belady_hit_ratio": round(belady, 4),
                       "belady_second_hit_only": round(second_hit, 4),
                       "of_belady": round(second_hit / belady, 3) if belady else None})
        for policy in policies:
            for admission in admissions:
                r = replay(trace, [("cache", cap)], policy, block_size=args.block_size, admission=admission)
                rows.append({"policy": label(policy, admission), "eviction": policy, "admission": admission,
                             "capacity_blocks": cap, "hit_ratio": round(r["hit_ratio"], 4),
                             "belady_hit_ratio": round(belady, 4),
                             "of_belady": round(r["hit_ratio"] / belady, 3) if belady else None})
    best = [max((r for r in rows if r["capacity_blocks"] == cap), key=lambda r: r["hit_ratio"])
            for cap in capacities] if rows else []
    tiers = [("device", args.device_blocks), ("host", args.host_blocks), ("disk", args.disk_blocks)]
    stack = [t for t in tiers if t[1]]
    tier_rows = []
    for layout in (x.split("/") for x in args.stack_admissions.split(";") if x):
        if len(layout) != len(tiers):
            p.error(f"--stack-admissions: {'/'.join(layout)} does not name device/host/disk")
        layout = [a for a, t in zip(layout, tiers, strict=True) if t[1]]
        for policy in policies:
            r = replay(trace, stack, policy, block_size=args.block_size, admission=layout)
            tier_rows.append({"policy": policy, "admission": "/".join(layout),
                              **{k: round(v, 4) for k, v in r.items()}})
    result = {
        "trace": str(args.trace), "part": args.part, "num_requests": len(trace),
        "num_blocks": sum(len(r.hash_ids) for r in trace),
        "ideal_hit_ratio": round(ideal_hit_ratio(trace), 4), "belady_exact": is_chained(trace), "rows": rows,
        "best": [{"capacity_blocks": b["capacity_blocks"], "policy": b["policy"], "of_belady": b["of_belady"]}
                 for b in best],
        "second_hit_bound": bounds,
        "tier_stack": {"capacity_blocks": dict(stack), "rows": tier_rows},
        "elapsed_s": round(time.perf_counter() - start, 1),
    }
    if args.json:
        print(json.dumps(result))
    else:
        _print(result, rows, tier_rows, result["best"])
    return 0
