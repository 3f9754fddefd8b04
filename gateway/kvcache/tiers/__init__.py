"""Storage tiers behind one interface (`tiers.base.Tier`): device, host, disk, redis, metadata."""
