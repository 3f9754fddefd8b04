"""The tiers a settings tree turns on, as built and as logged at the engine's start."""

from __future__ import annotations

from pathlib import Path

from gateway.kvcache.factory import build_tiers, describe_tiers, tier_budgets
from gateway.kvcache.settings import KVCacheSettings


def test_budgets_name_the_tiers_build_tiers_builds(tmp_path: Path) -> None:
    settings = KVCacheSettings(device="cpu", device_capacity_bytes=0, host_capacity_bytes=2 << 30,
                               disk_capacity_bytes=20 << 30, disk_dir=tmp_path, redis_url="redis://127.0.0.1:6379/0")
    budgets = tier_budgets(settings)
    assert budgets == {"host": 2 << 30, "disk": 20 << 30, "redis": None}
    tiers = build_tiers(settings)
    assert [(tier.name, budget) for tier, budget in tiers] == list(budgets.items())
    for tier, _ in tiers:
        tier.close()
    assert describe_tiers(budgets) == "host 2048 MiB, disk 20480 MiB, redis (Redis maxmemory)"
    assert describe_tiers({}) == "none"


def test_a_blank_disk_budget_is_off() -> None:
    """`.env.example` leaves it blank (compose's engines default it to 20 GB; the gateway reads the blank)."""
    assert KVCacheSettings.model_validate({"disk_capacity_bytes": ""}).disk_capacity_bytes == 0
