"""The real small model, loaded once per session, and runners over any tier stack."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gateway.engine.fuse import Fuser
from gateway.engine.model import LoadedModel, load_model
from gateway.engine.runner import ModelRunner
from gateway.engine.settings import EngineSettings
from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.factory import build_manager
from gateway.kvcache.settings import KVCacheSettings

NO_TIERS = {"device_capacity_bytes": 0, "host_capacity_bytes": 0, "disk_capacity_bytes": 0}


@pytest.fixture(scope="session")
def loaded_model() -> LoadedModel:
    settings = EngineSettings()
    return load_model(settings.model, settings.model_cache_dir)


@pytest.fixture
def make_runner(loaded_model: LoadedModel) -> Iterator[Callable[..., ModelRunner]]:
    """`make_runner(layerwise_min_tokens=..., fuse_share=..., loaded=..., **kvcache_fields)`: a runner
    over those tiers only; with `fuse_share` it fuses marked chunks at that recompute share; `loaded`
    replaces the session's model (e.g. the same one without its lean forward pass)."""
    made: list[ModelRunner] = []

    def make(layerwise_min_tokens: int = 100_000, fuse_share: float | None = None, loaded: LoadedModel | None = None,
             **fields: object) -> ModelRunner:
        model = loaded_model if loaded is None else loaded
        settings = KVCacheSettings(**{**NO_TIERS, **fields})
        layout = BlockLayout(model.num_layers, model.num_kv_heads, model.head_dim, settings.block_size, model.dtype)
        kv = build_manager(settings, model_id=model.model_id, layout=layout)
        fuser = None if fuse_share is None else Fuser(model, kv, recompute_share=fuse_share)
        runner = ModelRunner(model, kv, layerwise_min_tokens=layerwise_min_tokens, fuser=fuser)
        made.append(runner)
        return runner

    yield make
    for runner in made:
        runner.close()
        if runner.kv is not None:
            runner.kv.close()
