"""Settings of the tiered KV-cache engine.

A plain pydantic model, not `BaseSettings`: the gateway nests it in its one settings tree as
`settings.kvcache` (env `KVGATE_KVCACHE__<FIELD>`), and tests build it directly. A byte budget of 0
turns a tier off; `redis_url=None` turns the Redis tier off.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, Field, field_validator


class CodecName(StrEnum):
    SHRINK_ZSTD = "shrink-zstd"
    SHRINK_LZ4 = "shrink-lz4"
    RAW = "raw"


class WritePolicy(StrEnum):
    WRITE_THROUGH = "write-through"
    WRITE_BACK = "write-back"


class EvictionPolicyName(StrEnum):
    LRU = "lru"
    S3FIFO = "s3fifo"
    ARC = "arc"
    ARC_TAIL = "arc-tail"


class AdmissionName(StrEnum):
    AUTO = "auto"
    ALWAYS = "always"
    SECOND_HIT = "second-hit"
    TINYLFU = "tinylfu"


_MIB = 1 << 20
_GIB = 1 << 30


class KVCacheSettings(BaseModel):
    """Every knob of `gateway/kvcache`; one line of description each."""

    enabled: bool = Field(default=True, description="Use the tiered KV cache in the built-in engine.")
    block_size: int = Field(default=16, ge=1, description="Tokens per KV block; only full blocks are cached.")
    hash_seed: str = Field(default="kvgate-kv-v1", description="Seed mixed into every block hash chain.")
    share_across_tenants: bool = Field(
        default=False, description="Let tenants share blocks (drops the tenant salt from the chain)."
    )
    device: str = Field(default="auto", description="Device tier placement: auto (cuda if present), cpu, cuda:N.")
    device_capacity_bytes: int = Field(default=512 * _MIB, ge=0, description="Device tier budget; 0 = off.")
    device_verify: bool = Field(default=True, description="Check a cheap tensor checksum on device tier reads.")
    host_capacity_bytes: int = Field(default=2 * _GIB, ge=0, description="Host DRAM tier budget; 0 = off.")
    disk_capacity_bytes: int = Field(default=0, ge=0, description="Disk tier budget; 0 = off.")
    disk_dir: Path = Field(default=Path("./data/kvcache"), description="Directory of the disk tier.")
    disk_fsync: bool = Field(default=True, description="fsync each block file before it becomes visible.")
    redis_url: str | None = Field(default=None, description="Redis URL of the shared tier; unset = off.")
    redis_cluster: bool = Field(default=False, description="Talk to redis_url through the Redis Cluster client.")
    redis_key_prefix: str = Field(default="kvgate:kv:", description="Prefix of every KV block key in Redis.")
    redis_capacity_bytes: int | None = Field(
        default=None, ge=0, description="Bytes this replica may write to Redis; unset = leave it to maxmemory."
    )
    redis_ttl_s: int | None = Field(default=86400, ge=1, description="Expiry of KV blocks in Redis; unset = none.")
    redis_socket_timeout_s: float = Field(default=0.5, gt=0, description="Redis read/write timeout.")
    redis_connect_timeout_s: float = Field(default=0.5, gt=0, description="Redis connect timeout.")
    redis_retry_backoff_s: float = Field(default=1.0, gt=0, description="First wait before retrying a down Redis.")
    redis_retry_backoff_max_s: float = Field(default=30.0, gt=0, description="Longest wait between Redis retries.")
    device_codec: CodecName = Field(default=CodecName.RAW, description="Codec of the device tier (raw only).")
    host_codec: CodecName = Field(default=CodecName.RAW, description="Codec of the host tier.")
    # lz4 on disk (decodes at ~2.7 GB/s, ratio 0.67 on bf16), zstd for Redis (the network is slower
    # than either decoder, so the smaller ratio, 0.57, wins there).
    disk_codec: CodecName = Field(default=CodecName.SHRINK_LZ4, description="Codec of the disk tier.")
    redis_codec: CodecName = Field(default=CodecName.SHRINK_ZSTD, description="Codec of the Redis tier.")
    zstd_level: int = Field(default=1, ge=-7, le=22, description="zstd level of the shrink-zstd codec.")
    write_policy: WritePolicy = Field(
        default=WritePolicy.WRITE_THROUGH, description="write-through: store in every tier; write-back: on eviction."
    )
    eviction_policy: EvictionPolicyName = Field(
        default=EvictionPolicyName.S3FIFO, description="Eviction order inside each bounded tier."
    )
    # auto: second-hit where a slower local tier takes what this one refuses (write-through), else
    # always. Measured on the Mooncake trace (docs/benchmarks.md, "Trace replay"): as many prefix hits or
    # more, a tenth to a quarter of the writes to the upper tiers, more hits served by the device.
    device_admission: AdmissionName = Field(
        default=AdmissionName.AUTO, description="Which new blocks the full device tier takes (admission.py)."
    )
    host_admission: AdmissionName = Field(
        default=AdmissionName.AUTO, description="Which new blocks the full host tier takes."
    )
    disk_admission: AdmissionName = Field(
        default=AdmissionName.AUTO, description="Which new blocks the full disk tier takes."
    )
    redis_admission: AdmissionName = Field(
        default=AdmissionName.AUTO, description="Which new blocks Redis takes once redis_capacity_bytes is used."
    )
    write_behind_max_blocks: int = Field(
        default=512, ge=0, description="Blocks queued for the background writer before stores drop; 0 = inline."
    )
    write_behind_read_wait_s: float = Field(
        default=5.0, ge=0, description="A restore waits this long for a pending store of its own conversation."
    )
    prefetch_budget_bytes: int = Field(
        default=256 * _MIB, ge=0, description="Host bytes of next-turn blocks prefetched ahead of use; 0 = off."
    )
    prefetch_lead_s: float = Field(default=0.5, ge=0, description="Prefetch this long before a next turn is due.")
    skip_slow_tiers: bool = Field(default=True, description="Recompute instead of loading from a slower tier.")

    @field_validator("redis_url", "redis_capacity_bytes", "redis_ttl_s", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: object) -> object:
        # `KVGATE_KVCACHE__REDIS_URL=` in a .env file means "unset", not an empty URL.
        return None if value == "" else value

    @field_validator("disk_capacity_bytes", mode="before")
    @classmethod
    def _blank_disk_is_off(cls, value: object) -> object:
        # `.env.example` leaves it blank so that compose's `${...:-20 GB}` for the engines stands;
        # the gateway containers read the same blank line from their env_file.
        return 0 if value == "" else value
