"""Settings of the built-in engine (`settings.engine`, env `KVGATE_ENGINE__<FIELD>`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, field_validator


def default_model_cache() -> Path:
    return Path.home() / ".cache" / "kvgate" / "models"


class EngineSettings(BaseModel):
    model: str = Field(
        default="smollm2", description="'smollm2' (the packaged SmolLM2-135M-Instruct) or a local HF model directory."
    )
    served_model_name: str = Field(default="smollm2-135m-instruct", description="Model id clients ask for.")
    model_cache_dir: Path = Field(
        default_factory=default_model_cache, description="Where the GGUF model is converted to safetensors once."
    )
    device: str = Field(default="auto", description="auto (cuda if present), cpu, cuda:N.")
    dtype: str = Field(default="auto", description="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16.")
    forward_path: str = Field(
        default="lean", description="lean (own Llama forward over a preallocated KV pool), or transformers (previous)."
    )
    weights: str = Field(
        default="auto",
        description="Lean path matmul weights: auto (int4 on CPU), int4 (kvgate's kernel where it was built and the"
        " CPU has AVX-512: activations rounded to int16 per group of 32 where it has VNNI, else float32; else"
        " torch's), int4-f32 (kvgate's kernel, float32 activations), int4-torch (torch's kernel, bfloat16"
        " activations), bfloat16, float32 (exact).",
    )
    num_threads: int | None = Field(default=None, ge=1, description="torch CPU threads; unset = torch's default.")
    max_context_tokens: int = Field(default=8192, ge=16, description="Longest prompt + completion accepted.")
    default_max_tokens: int = Field(default=256, ge=1, description="Completion length when max_tokens is not given.")
    default_temperature: float = Field(
        default=0.0, ge=0, le=2, description="Temperature when the request gives none (0 = greedy)."
    )
    max_queue: int = Field(default=256, ge=1, description="Requests waiting for the model before 429.")
    max_batch_sequences: int = Field(
        default=16, ge=1, description="Sequences stepped together in one forward pass (continuous batching)."
    )
    prefill_chunk_tokens: int = Field(
        default=256, ge=1, description="Prompt tokens prefilled per step while other sequences decode."
    )
    layerwise_min_tokens: int = Field(
        default=1024, ge=0, description="Restore layer by layer, overlapped with compute, from this prefix length."
    )
    fuse_enabled: bool = Field(
        default=True, description="Reuse the KV of chunks a request marks (kvgate.fuse), wherever they sit."
    )
    fuse_recompute_share: float = Field(
        default=0.15, ge=0, le=1,
        description="Share of reused chunk tokens recomputed (those the question attends to most).",
    )
    fuse_sink_tokens: int = Field(
        default=16, ge=0, description="First tokens of each reused chunk always recomputed (its attention sink)."
    )

    @field_validator("num_threads", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("model_cache_dir", mode="after")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()
