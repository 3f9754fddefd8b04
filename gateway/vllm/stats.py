"""What kvgate's connector reports through vLLM's own metrics path.

The worker hands vLLM a `KvgateStats` after each step (counter increments since the last one, and
the latest per-tier snapshot); vLLM carries it to its front-end process, where `KvgatePromMetrics`
puts it on vLLM's `/metrics` page:

    vllm:kvgate_tier_blocks{tier}       blocks this server holds in each bounded tier (host, disk)
    vllm:kvgate_tier_used_bytes{tier}   their bytes
    vllm:kvgate_loaded_blocks_total     blocks loaded from the tiers instead of prefilled
    vllm:kvgate_saved_blocks_total      blocks handed to the writer
    vllm:kvgate_dropped_blocks_total    saves dropped because the writer's queue was full
    vllm:kvgate_load_errors_total       blocks promised but not loaded (gone, damaged, tier down): prefilled

kvgate's gateway reads them from each vLLM upstream for its dashboard's KV tiers table.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS = ("loaded_blocks", "saved_blocks", "dropped_blocks", "load_errors")


class KvgateStats(KVConnectorStats):
    """`data`: {"loaded_blocks": n, ..., "tiers": [{"tier", "blocks", "used_bytes"}, ...]}."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {**dict.fromkeys(COUNTERS, 0), "tiers": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        if other.data.get("tiers"):
            self.data["tiers"] = other.data["tiers"]  # a snapshot: the latest wins
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data.get(name, 0) for name in COUNTERS}
        for tier in self.data.get("tiers") or []:
            if tier.get("blocks") is not None:
                out[f"{tier['tier']}_blocks"] = tier["blocks"]
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS) and not self.data.get("tiers")


class KvgatePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvgate_{name}", documentation=f"kvgate connector: {name}.",
                                  labelnames=labelnames), per_engine_labelvalues)
            for name in COUNTERS
        }
        self.tier_blocks = self._gauge_cls(name="vllm:kvgate_tier_blocks", labelnames=[*labelnames, "tier"],
                                           documentation="kvgate connector: blocks held in each bounded tier.",
                                           multiprocess_mode="mostrecent")
        self.tier_bytes = self._gauge_cls(name="vllm:kvgate_tier_used_bytes", labelnames=[*labelnames, "tier"],
                                          documentation="kvgate connector: bytes held in each bounded tier.",
                                          multiprocess_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in COUNTERS:
            value = transfer_stats_data.get(name, 0)
            if value:
                self.counters[name][engine_idx].inc(value)
        labels = self.per_engine_labelvalues[engine_idx]
        for tier in transfer_stats_data.get("tiers") or []:
            if tier.get("blocks") is None:
                continue  # Redis: shared and bounded by its own maxmemory, not counted per server
            self.tier_blocks.labels(*labels, tier["tier"]).set(tier["blocks"])
            self.tier_bytes.labels(*labels, tier["tier"]).set(tier["used_bytes"])

