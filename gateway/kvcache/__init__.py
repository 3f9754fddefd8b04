"""The tiered KV-cache engine: block hash chains, tiers (device, host, disk, redis), the lossless
"shrink" codec, eviction policies and the manager. No HTTP, no model: the engine plugs it in.

Entry points: `factory.build_manager(settings.kvcache, model_id=..., layout=BlockLayout(...))`, then
`manager.lookup / load / release / store`.
"""
