"""Settings of llama.cpp slot files in kvgate's tiers (`settings.slots`, env `KVGATE_SLOTS__<FIELD>`).

Each llama.cpp upstream also needs `slot_dir` in its own settings: the directory kvgate sees as that
server's `--slot-save-path` (the same path for a local process, the server's volume mounted into
kvgate's container in compose). Without it kvgate still pins conversations to slots but keeps no
files.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class SlotSettings(BaseModel):
    enabled: bool = Field(default=True, description="Pin conversations to llama.cpp slots; save and restore them.")
    host_mb: int = Field(default=2048, ge=0, description="Host memory for saved slot files (MiB); 0: none.")
    disk_dir: str | None = Field(default=None, description="A directory for slot files (kept across restarts).")
    disk_mb: int = Field(default=20480, ge=0, description="Disk budget for slot files (MiB).")
    redis_url: str | None = Field(default=None, description="Redis for slot files shared by every kvgate replica.")
    redis_cluster: bool = Field(default=False, description="redis_url names a Redis Cluster node.")
    redis_ttl_s: int = Field(default=24 * 3600, gt=0, description="Seconds a slot file stays in Redis.")
    compress: bool = Field(
        default=True, description="Compress slot files on disk and in Redis losslessly (byte planes + zstd); host "
        "memory keeps them uncompressed, off the restore's path."
    )
    save_wait_s: float = Field(
        default=10.0, gt=0, description="Longest a request waits for the slot it needs to finish saving its last user."
    )
    min_gain_blocks: int = Field(
        default=1, ge=1, description="Restore only when the file covers this many more prefix blocks than the slot."
    )
