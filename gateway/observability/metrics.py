"""Every Prometheus metric kvgate exports, in one place.

Two kinds:

- Request metrics (counters, histograms, gauges) are updated as requests finish: `Metrics.observe`
  reads the `RequestRecord` the proxy already builds for the request log, so the request path
  needs no metric calls of its own.
- State metrics (KV tiers, engine queue, dropped log rows) are read at scrape time by
  `LiveCollector` from the objects that own the state (`KVCacheManager.stats()`), never copied.

Several worker processes: when `PROMETHEUS_MULTIPROC_DIR` is set before the process starts (an
empty directory, cleared before each start), prometheus-client keeps request metrics in memory-
mapped files there and `/metrics` sums every worker's files (`MultiProcessCollector`). State
metrics describe the process that answered the scrape; run the engine as `kvgate engine` and scrape
it separately to see one KV cache whatever the number of gateway workers.

Labels never carry API keys, upstream keys, tenants' prompt text or client-chosen strings other
than the model of a successful request (a served model, so bounded).

Longer than 300 lines on purpose: every Prometheus metric lives in this one module (the
architecture's rule), so that a name or label is defined, and reviewed, in one place.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.responses import Response

from gateway.responsecache.status import HIT_KINDS, CacheStatus

if TYPE_CHECKING:
    from gateway.engine.service import Engine
    from gateway.kvcache.manager import KVCacheManager
    from gateway.limits.gate import Gate
    from gateway.observability.settings import ObservabilitySettings
    from gateway.persistence.request_log import Backlog, RequestLogWriter, RequestRecord
    from gateway.slots.keeper import SlotKeeper
    from gateway.upstream.router import Router
from gateway.usage.settings import Price

PriceFor = Callable[[str | None], Price | None]  # None: the model is not priced

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_KINDS = ("prompt", "cached", "cache_creation", "completion")
# hit-inflight: answered from an identical request's upstream call (single-flight); it saved a call too.


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


@dataclass(slots=True, frozen=True)
class PrefixBreak:
    """Where a request's prompt stopped matching the cached prefix, and why; never prompt text."""

    created_at: float
    reason: str
    tenant: str
    model: str | None
    block_index: int | None


class Metrics:
    """The request metrics of one app, in their own registry (tests build many apps per process)."""

    def __init__(self, settings: ObservabilitySettings, price_for: PriceFor) -> None:
        self.price_for = price_for
        self.settings = settings
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvgate_requests", "Finished requests by route, status and response-cache result",
                                ["route", "status", "cache"], registry=r)
        self.duration = Histogram("kvgate_request_duration_seconds", "Total request latency",
                                  ["route", "cache"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.ttft = Histogram("kvgate_time_to_first_token_seconds",
                              "Time to the first byte of the answer (first token when streaming)",
                              ["route", "cache"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.tokens = Counter("kvgate_tokens", "Tokens by kind: prompt, cached (read from a KV cache), "
                              "cache_creation (written to one), completion", ["kind", "model"], registry=r)
        self.cache_lookups = Counter("kvgate_response_cache_lookups",
                                     "Response-cache lookups by result (hit-exact, hit-semantic, miss)",
                                     ["result"], registry=r)
        self.cache_hits = Counter("kvgate_response_cache_hits", "Response-cache hits by kind (exact, semantic)",
                                  ["kind"], registry=r)
        self.cache_feedback = Counter("kvgate_cache_feedback", "Clients' verdicts on response-cache hits "
                                      "(POST /v1/kvgate/feedback): wrong, correct", ["verdict"], registry=r)
        self.semantic_skipped = Counter(
            "kvgate_response_cache_semantic_skipped",
            "Response-cache misses forwarded without a semantic lookup, by reason: busy (the semantic cache's CPU "
            "budget was spent: KVGATE_RESPONSECACHE__SEMANTIC_CPU_SHARE), sampling, trivial, too-long, "
            "language-not-validated", ["reason"], registry=r)
        self.cache_bypass = Counter("kvgate_response_cache_bypass",
                                    "Requests that skipped the response cache (cache controls)", registry=r)
        self.saved_tokens = Counter("kvgate_saved_tokens",
                                    "Tokens not computed upstream, by source (response_cache, kv_cache, condensing)",
                                    ["source"], registry=r)
        self.saved_cost = Counter("kvgate_saved_cost_dollars",
                                  "Estimated cost saved, by source, at the configured prices",
                                  ["source"], registry=r)
        self.prefix_breaks = Counter("kvgate_prefix_breaks", "Requests whose prompt prefix stopped matching "
                                     "a cached prefix, by reason", ["reason"], registry=r)
        self.in_flight = Gauge("kvgate_in_flight_requests", "HTTP requests being served, by route",
                               ["route"], multiprocess_mode="livesum", registry=r)
        self.upstream_errors = Counter("kvgate_upstream_errors", "Failed upstream requests by upstream and error",
                                       ["upstream", "error"], registry=r)
        self.recent_breaks: deque[PrefixBreak] = deque(maxlen=settings.recent_prefix_breaks)
        self.live = LiveCollector()
        self.registry.register(self.live)
        # Children by metric and label values: prometheus-client's `labels()` validates, converts and
        # locks on every call (about 5 us each, eight a request); the values are bounded (see above).
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}

    def child(self, metric: Counter | Gauge | Histogram, *values: str) -> Any:
        """`metric.labels(*values)`, looked up once."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    # ----------------------------------------------------------------- request path

    def observe(self, record: RequestRecord) -> None:
        """One finished request, from the row the proxy writes to the request log."""
        cache = record.cache or "none"
        self.child(self.requests, record.route, str(record.status), cache).inc()
        self.child(self.duration, record.route, cache).observe(record.total_ms / 1000)
        if record.ttfb_ms is not None and record.status < 400:
            self.child(self.ttft, record.route, cache).observe(record.ttfb_ms / 1000)
        self._observe_cache(cache)
        if record.semantic_skipped is not None:  # a fixed vocabulary (responsecache/lookup.py)
            self.child(self.semantic_skipped, record.semantic_skipped).inc()
        if record.upstream is not None and record.status >= 500:
            self.child(self.upstream_errors, record.upstream, record.error_type or str(record.status)).inc()
        if record.status < 400:
            self._observe_tokens(record, cache)

    def _observe_cache(self, cache: str) -> None:
        if cache in HIT_KINDS or cache == CacheStatus.MISS:
            self.child(self.cache_lookups, cache).inc()
        if cache in HIT_KINDS:
            self.child(self.cache_hits, HIT_KINDS[cache]).inc()
        elif cache == CacheStatus.BYPASS:
            self.cache_bypass.inc()

    def _observe_tokens(self, record: RequestRecord, cache: str) -> None:
        """Tokens used and what the caches saved (tokens and, where priced, cost)."""
        model = record.model or ""
        counts = token_counts(record)
        for kind in TOKEN_KINDS:
            if counts[kind]:
                self.child(self.tokens, kind, model).inc(counts[kind])
        price = self.price_for(record.model)
        if cache in HIT_KINDS:
            saved = counts["prompt"] + counts["completion"]
            self.child(self.saved_tokens, "response_cache").inc(saved)
            if price is not None:
                self.child(self.saved_cost, "response_cache").inc(
                    (counts["prompt"] * price.input + counts["completion"] * price.output) / 1e6)
        elif counts["cached"]:
            self.child(self.saved_tokens, "kv_cache").inc(counts["cached"])
            if price is not None:
                discount = max(price.input - price.cached_input, 0.0)
                self.child(self.saved_cost, "kv_cache").inc(counts["cached"] * discount / 1e6)
        condensed = getattr(record, "condensed_from_tokens", None)
        if condensed is not None and cache not in HIT_KINDS and condensed > counts["prompt"]:
            # Tokens the small model cut from the prompt: never sent, so paid at the full input price.
            self.child(self.saved_tokens, "condensing").inc(condensed - counts["prompt"])
            if price is not None:
                self.child(self.saved_cost, "condensing").inc((condensed - counts["prompt"]) * price.input / 1e6)

    def observe_prefix_break(self, reason: str, *, tenant: str, model: str | None = None,
                             block_index: int | None = None) -> None:
        """A request whose prompt broke the cached prefix. `reason` is a short fixed word (the
        prefix-break diagnostics of canonical/ choose it), never text taken from the prompt."""
        self.prefix_breaks.labels(reason).inc()
        self.recent_breaks.append(PrefixBreak(time.time(), reason, tenant, model, block_index))

    # ----------------------------------------------------------------- exposition

    def exposition(self) -> bytes:
        """The text format for one scrape: every worker's request metrics in multiprocess mode,
        this process's state metrics either way."""
        if multiprocess_dir() is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        registry.register(self.live)
        return generate_latest(registry)


def token_counts(record: RequestRecord) -> dict[str, int]:
    """Tokens by kind. Without a reported cache-creation count, prompt tokens not read from cache
    count as written to it: that is what a prefix-caching engine does with them."""
    prompt = record.prompt_tokens or 0
    cached = min(record.cached_tokens or 0, prompt) if prompt else (record.cached_tokens or 0)
    creation = getattr(record, "cache_creation_tokens", None)
    if creation is None:
        creation = 0 if record.cache in HIT_KINDS else max(prompt - cached, 0)
    return {"prompt": prompt, "cached": cached, "cache_creation": creation,
            "completion": record.completion_tokens or 0}


class LiveCollector(Collector):
    """State read at scrape time: upstream health and load from the router, the in-process
    engine's KV tiers and queue, the request log's dropped rows."""

    def __init__(self) -> None:
        self.kv: KVCacheManager | None = None
        self.engine: Engine | None = None
        self.request_log: RequestLogWriter | None = None
        self.router: Router | None = None
        self.gate: Gate | None = None

    def attach(self, *, engine: Engine | None = None, request_log: RequestLogWriter | None = None,
               router: Router | None = None, gate: Gate | None = None) -> None:
        self.engine = engine
        self.kv = engine.kv if engine is not None else None
        self.request_log = request_log
        self.router = router
        self.gate = gate

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self.request_log is not None:
            yield from request_log_metrics(self.request_log.backlog())
        if self.router is not None:
            yield from upstream_metrics(self.router)
        if self.engine is not None:
            yield GaugeMetricFamily("kvgate_engine_queue_requests", "Requests waiting for the built-in engine",
                                    value=self.engine.worker.num_pending)
        if self.kv is not None:
            yield from kv_metrics(self.kv)
        if self.engine is not None:
            yield from engine_kv_work_metrics(self.engine)
        if self.router is not None and self.router.slots is not None and self.router.slots.servers():
            yield from slot_metrics(self.router.slots)
        if self.router is not None and self.router.vllm is not None:
            yield from vllm_metrics(self.router)
        if self.gate is not None:
            refused = CounterMetricFamily("kvgate_limit_refusals", "Requests refused by a key's or tenant's limit "
                                          "(429), by kind: requests, tokens, parallel, budget", labels=["kind"])
            for kind, count in sorted(self.gate.refused.items()):
                refused.add_metric([kind], count)
            yield refused


def request_log_metrics(backlog: Backlog) -> Iterator[Metric]:
    yield CounterMetricFamily("kvgate_request_log_dropped_rows", "Request-log rows dropped (queue full, "
                              "database down, a row the database refused)", value=backlog.num_dropped)
    yield CounterMetricFamily("kvgate_request_log_written_rows", "Request-log rows written", value=backlog.num_written)
    yield GaugeMetricFamily("kvgate_request_log_queued_rows", "Request-log rows recorded and not yet written "
                            "(past KVGATE_REQUEST_LOG_MAX_QUEUE they are dropped)", value=backlog.num_queued)
    yield GaugeMetricFamily("kvgate_request_log_oldest_queued_seconds", "How long the oldest request-log row not "
                            "yet written has waited (0 when none waits)", value=backlog.oldest_age_s or 0.0)


def upstream_metrics(router: Router) -> Iterator[Metric]:
    up = GaugeMetricFamily("kvgate_upstream_up", "1 when the upstream takes requests (health check passed, "
                           "circuit not open)", labels=["upstream"])
    in_flight = GaugeMetricFamily("kvgate_upstream_in_flight_requests", "Requests open at the upstream",
                                  labels=["upstream"])
    retries = CounterMetricFamily("kvgate_upstream_retries", "Requests sent again because the upstream failed "
                                  "them, by cause: stale_connection (a pooled keep-alive connection it dropped), "
                                  "connect_error, server_error (a 5xx: failed over), not_served (a 501: failed "
                                  "over)", labels=["upstream", "cause"])
    # Read defensively: the router's health bookkeeping is optional to this module.
    health = getattr(router, "health", None) or {}
    for backend in router.backends:
        state = health.get(backend.name)
        if state is None:
            continue
        up.add_metric([backend.name], 1 if state.available() else 0)
        in_flight.add_metric([backend.name], state.in_flight)
        for cause, count in sorted(router.retries(backend).items()):
            retries.add_metric([backend.name, cause], count)
    yield up
    yield in_flight
    yield retries


def vllm_metrics(router: Router) -> Iterator[Metric]:
    """vLLM servers routed on their KV events (gateway/vllm): what each holds, and the requests sent
    elsewhere than to the server holding most of their prefix."""
    assert router.vllm is not None
    yield CounterMetricFamily("kvgate_upstream_misrouted", "Requests sent to a vLLM server holding fewer of "
                              "their prefix blocks than another one did (by the KV events, at the choice)",
                              value=router.num_misrouted)
    blocks = GaugeMetricFamily("kvgate_vllm_blocks", "KV blocks a vLLM server holds, by its KV events",
                               labels=["upstream"])
    batches = CounterMetricFamily("kvgate_vllm_event_batches", "KV-event batches read from a vLLM server "
                                  "(live and replayed)", labels=["upstream"])
    for server in router.vllm.servers():
        blocks.add_metric([server.backend.name], len(server.blocks))
        batches.add_metric([server.backend.name], server.subscriber.num_batches)
    yield blocks
    yield batches


def slot_metrics(keeper: SlotKeeper) -> Iterator[Metric]:
    """llama.cpp slots: restores and saves through kvgate's tiers, and the files each tier holds
    (the host and disk tiers of this replica; Redis is counted on the dashboard, not per scrape)."""
    stats = keeper.stats
    restores = CounterMetricFamily("kvgate_slot_restores", "Slot files restored into llama.cpp slots before a "
                                   "request, by outcome (restored, failed, missing)", labels=["upstream", "outcome"])
    for (upstream, outcome), n in sorted(stats.restores.items()):
        restores.add_metric([upstream, outcome], n)
    yield restores
    saves = CounterMetricFamily("kvgate_slot_saves", "llama.cpp slots saved into kvgate's tiers after a turn, "
                                "by outcome", labels=["upstream", "outcome"])
    for (upstream, outcome), n in sorted(stats.saves.items()):
        saves.add_metric([upstream, outcome], n)
    yield saves
    yield CounterMetricFamily("kvgate_slot_restore_seconds", "Seconds spent restoring slot files before requests "
                              "(tier read, file written, the server's load)", value=stats.restore_s)
    yield CounterMetricFamily("kvgate_slot_save_seconds", "Seconds spent saving slots after turns, off the "
                              "requests' path (the server's save, file read, codec, tiers)", value=stats.save_s)
    if keeper.store is None:
        return
    files = GaugeMetricFamily("kvgate_slot_files", "Slot files held, by tier", labels=["tier"])
    held = GaugeMetricFamily("kvgate_slot_bytes", "Bytes of slot files held (after the codec), by tier",
                             labels=["tier"])
    for tier in keeper.store.tiers:
        if tier.name == "redis":
            continue
        count, used = tier.files()
        files.add_metric([tier.name], count)
        held.add_metric([tier.name], used)
    yield files
    yield held
    yield CounterMetricFamily("kvgate_slot_corrupt_files", "Slot files found damaged (checksum) and dropped",
                              value=keeper.store.corrupt)


def kv_metrics(kv: KVCacheManager) -> Iterator[Metric]:
    stats = kv.stats()
    yield CounterMetricFamily("kvgate_kv_lookups", "KV-cache prefix lookups", value=stats.num_lookups)
    yield CounterMetricFamily("kvgate_kv_lookup_tokens", "Tokens looked up in the KV cache",
                              value=stats.num_lookup_tokens)
    yield CounterMetricFamily("kvgate_kv_hit_tokens", "Tokens found in the KV cache", value=stats.num_hit_tokens)
    yield CounterMetricFamily("kvgate_kv_stored_blocks", "KV blocks stored", value=stats.num_stored_blocks)
    yield GaugeMetricFamily("kvgate_kv_pinned_blocks", "KV blocks pinned by running requests",
                            value=stats.num_pinned_blocks)
    families: dict[str, Any] = {
        "up": GaugeMetricFamily("kvgate_kv_tier_up", "1 when the tier is reachable", labels=["tier"]),
        "blocks": GaugeMetricFamily("kvgate_kv_tier_blocks", "Blocks held by the tier", labels=["tier"]),
        "used": GaugeMetricFamily("kvgate_kv_tier_used_bytes", "Bytes held by the tier", labels=["tier"]),
        "capacity": GaugeMetricFamily("kvgate_kv_tier_capacity_bytes", "Byte budget of the tier", labels=["tier"]),
        "hits": CounterMetricFamily("kvgate_kv_tier_hits", "Block loads found in the tier", labels=["tier"]),
        "misses": CounterMetricFamily("kvgate_kv_tier_misses", "Block loads not found in the tier",
                                      labels=["tier"]),
        "evictions": CounterMetricFamily("kvgate_kv_tier_evictions", "Blocks evicted from the tier",
                                         labels=["tier"]),
        "corrupt": CounterMetricFamily("kvgate_kv_tier_corrupt_blocks", "Blocks dropped for a failed checksum",
                                       labels=["tier"]),
        "rejected": CounterMetricFamily("kvgate_kv_tier_admission_rejects", "Blocks the full tier's admission "
                                        "policy refused", labels=["tier"]),
        "read": CounterMetricFamily("kvgate_kv_tier_read_bytes", "Bytes loaded from the tier (decoded)",
                                    labels=["tier"]),
        "written": CounterMetricFamily("kvgate_kv_tier_written_bytes", "Bytes stored in the tier (encoded)",
                                       labels=["tier"]),
        "bandwidth": GaugeMetricFamily("kvgate_kv_tier_load_bytes_per_second",
                                       "Measured load bandwidth of the tier", labels=["tier"]),
        "ratio": GaugeMetricFamily("kvgate_kv_codec_ratio", "Raw bytes per stored byte of the tier's blocks "
                                   "(1 for raw tiers)", labels=["tier"]),
    }
    block_bytes = kv.layout.block_nbytes if kv.layout is not None else None
    for tier in stats.tiers:
        labels = [tier.name]
        families["up"].add_metric(labels, 1 if tier.up else 0)
        if tier.num_blocks is not None:
            families["blocks"].add_metric(labels, tier.num_blocks)
        if tier.used_bytes is not None:
            families["used"].add_metric(labels, tier.used_bytes)
        if tier.capacity_bytes is not None:
            families["capacity"].add_metric(labels, tier.capacity_bytes)
        families["hits"].add_metric(labels, tier.hits)
        families["misses"].add_metric(labels, tier.misses)
        families["evictions"].add_metric(labels, tier.evictions)
        families["corrupt"].add_metric(labels, tier.corrupt)
        families["rejected"].add_metric(labels, tier.rejected)
        families["read"].add_metric(labels, tier.bytes_out)
        families["written"].add_metric(labels, tier.bytes_in)
        if tier.load_gbps is not None:
            families["bandwidth"].add_metric(labels, tier.load_gbps * 1e9)
        if block_bytes and tier.num_blocks and tier.used_bytes:
            families["ratio"].add_metric(labels, tier.num_blocks * block_bytes / tier.used_bytes)
    yield from families.values()


def engine_kv_work_metrics(engine: Engine) -> Iterator[Metric]:
    """The engine's background KV work: write-behind stores (and drops) and next-turn prefetch."""
    writer = getattr(engine, "writer", None)
    if writer is not None:
        w = writer.stats
        yield CounterMetricFamily("kvgate_kv_write_behind_written_blocks", "KV blocks written by the write-behind "
                                  "queue", value=w.num_written_blocks)
        yield CounterMetricFamily("kvgate_kv_write_behind_dropped_stores", "KV stores dropped because the "
                                  "write-behind queue was full (decoding never waits for a store)",
                                  value=w.num_dropped_stores)
        yield CounterMetricFamily("kvgate_kv_write_behind_dropped_blocks", "KV blocks in dropped stores",
                                  value=w.num_dropped_blocks)
        yield GaugeMetricFamily("kvgate_kv_write_behind_pending_blocks", "KV blocks waiting to be written",
                                value=w.num_pending_blocks)
    planner = getattr(engine, "planner", None)
    if planner is not None:
        p = planner.stats
        yield CounterMetricFamily("kvgate_kv_prefetched_blocks", "KV blocks promoted to host ahead of a "
                                  "conversation's next turn", value=p.num_prefetched_blocks)
        yield CounterMetricFamily("kvgate_kv_prefetch_cancelled", "Prefetches put off or stopped under "
                                  "pressure", value=p.num_cancelled)


def engine_metrics_response(engine: Engine) -> Response:
    """`/metrics` of `kvgate engine`: the KV tiers and the queue of this engine process."""
    registry = CollectorRegistry(auto_describe=True)
    live = LiveCollector()
    live.attach(engine=engine)
    registry.register(live)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
