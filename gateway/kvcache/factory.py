"""Builds the tier stack and the manager from `KVCacheSettings`; the only place that does."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.codec import build_codec
from gateway.kvcache.keys import ChainKeyer
from gateway.kvcache.manager import KVCacheManager
from gateway.kvcache.settings import AdmissionName, CodecName, KVCacheSettings
from gateway.kvcache.tiers.base import Tier
from gateway.kvcache.tiers.device import DeviceTier, resolve_device
from gateway.kvcache.tiers.disk import DiskTier
from gateway.kvcache.tiers.host import HostTier
from gateway.kvcache.tiers.metadata import MetadataTier
from gateway.kvcache.tiers.redis import RedisTier, redis_client_factory


def tier_budgets(settings: KVCacheSettings) -> dict[str, int | None]:
    """The tiers these settings turn on, fastest first, and their byte budgets (None: Redis without
    a budget of its own, left to its maxmemory); what `build_tiers` builds."""
    s = settings
    budgets = {"device": s.device_capacity_bytes, "host": s.host_capacity_bytes, "disk": s.disk_capacity_bytes}
    tiers: dict[str, int | None] = {name: budget for name, budget in budgets.items() if budget}
    if s.redis_url is not None:
        tiers["redis"] = s.redis_capacity_bytes
    return tiers


def describe_tiers(budgets: dict[str, int | None]) -> str:
    """One line for the start-up log: `device 512 MiB, host 2048 MiB, redis (Redis maxmemory)`."""
    if not budgets:
        return "none"
    return ", ".join(f"{name} {budget // 2**20} MiB" if budget is not None else f"{name} (Redis maxmemory)"
                     for name, budget in budgets.items())


def build_tiers(settings: KVCacheSettings) -> list[tuple[Tier, int | None]]:
    """(tier, byte budget) fastest first; tiers with a zero budget or no URL are left out."""
    s = settings
    budgets = tier_budgets(s)
    tiers: list[tuple[Tier, int | None]] = []
    if "device" in budgets:
        if s.device_codec != CodecName.RAW:
            raise ValueError("the device tier stores tensors; device_codec must be raw")
        tiers.append((DeviceTier(resolve_device(s.device), verify=s.device_verify), budgets["device"]))
    if "host" in budgets:
        tiers.append((HostTier(build_codec(s.host_codec, zstd_level=s.zstd_level)), budgets["host"]))
    if "disk" in budgets:
        codec = build_codec(s.disk_codec, zstd_level=s.zstd_level)
        tiers.append((DiskTier(s.disk_dir, codec, fsync=s.disk_fsync), budgets["disk"]))
    if s.redis_url is not None:
        make = redis_client_factory(
            s.redis_url, cluster=s.redis_cluster, socket_timeout_s=s.redis_socket_timeout_s,
            connect_timeout_s=s.redis_connect_timeout_s,
        )
        tier = RedisTier(
            make, build_codec(s.redis_codec, zstd_level=s.zstd_level), key_prefix=s.redis_key_prefix,
            ttl_s=s.redis_ttl_s, backoff_s=s.redis_retry_backoff_s, backoff_max_s=s.redis_retry_backoff_max_s,
        )
        tiers.append((tier, budgets["redis"]))
    return tiers


def build_manager(
    settings: KVCacheSettings,
    *,
    model_id: str,
    layout: BlockLayout,
    recompute_s_per_token: float | None = None,
) -> KVCacheManager:
    """The manager for one model; `layout.block_size` must equal `settings.block_size`."""
    if layout.block_size != settings.block_size:
        raise ValueError(f"layout block_size {layout.block_size} != settings {settings.block_size}")
    keyer = ChainKeyer(settings.block_size, settings.hash_seed, model_id, layout.dtype_name, layout.describe())
    tiers = build_tiers(settings)
    return KVCacheManager(
        tiers, keyer=keyer, layout=layout, device=resolve_device(settings.device),
        eviction_policy=settings.eviction_policy, write_policy=settings.write_policy,
        recompute_s_per_token=recompute_s_per_token, skip_slow_tiers=settings.skip_slow_tiers,
        share_across_tenants=settings.share_across_tenants,
        admission=[admission_of(settings, tier.name) for tier, _ in tiers],
    )


def admission_of(settings: KVCacheSettings, tier_name: str) -> AdmissionName:
    """The admission setting of a tier built by `build_tiers`."""
    s = settings
    by_tier = {"device": s.device_admission, "host": s.host_admission, "disk": s.disk_admission,
               "redis": s.redis_admission}
    return by_tier[tier_name]


def build_metadata_manager(
    capacities_blocks: list[tuple[str, int | None]],
    *,
    block_size: int,
    settings: KVCacheSettings | None = None,
    admission: AdmissionName | Sequence[AdmissionName] = AdmissionName.AUTO,
) -> KVCacheManager:
    """A tensor-free manager whose tiers hold `capacities_blocks` blocks each (trace replay);
    `admission` for every tier or one per tier (the tiers are named by the caller)."""
    s = settings or KVCacheSettings(block_size=block_size)
    tiers: list[tuple[Tier, int | None]] = [
        (MetadataTier(name, block_nbytes=1), cap) for name, cap in capacities_blocks
    ]
    keyer = ChainKeyer(block_size, s.hash_seed, "trace", "none", "metadata")
    return KVCacheManager(tiers, keyer=keyer, layout=None, eviction_policy=s.eviction_policy,
                          write_policy=s.write_policy, admission=admission)
