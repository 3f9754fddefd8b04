"""/metrics after real requests through the gateway: counts, cache results, tokens, latency."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from gateway.kvcache.blocks import BlockLayout
from gateway.kvcache.factory import build_manager
from gateway.kvcache.settings import KVCacheSettings
from gateway.observability.metrics import engine_metrics_response
from tests.conftest import Gateway
from tests.observability.conftest import MODEL, chat, scrape, value


def test_requests_hits_and_tokens_move_the_counters(obs_gateway: Gateway) -> None:
    before = scrape(obs_gateway)
    first = chat(obs_gateway, "metrics question one about tides")
    again = chat(obs_gateway, "metrics question one about tides")
    assert first.headers.get("x-kvgate-cache") == "miss"
    assert again.headers.get("x-kvgate-cache") == "hit-exact"
    streamed = chat(obs_gateway, "metrics question two streamed", stream=True)
    assert b"[DONE]" in streamed.content
    after = scrape(obs_gateway)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    route = "chat.completions"
    assert delta("kvgate_requests_total", route=route, status="200", cache="miss") == 2
    assert delta("kvgate_requests_total", route=route, status="200", cache="hit-exact") == 1
    assert delta("kvgate_response_cache_lookups_total", result="miss") == 2
    assert delta("kvgate_response_cache_lookups_total", result="hit-exact") == 1
    assert delta("kvgate_response_cache_hits_total", kind="exact") == 1
    assert delta("kvgate_response_cache_hits_total", kind="semantic") == 0

    usage = first.json()["usage"]
    streamed_prompt = 4 + 8  # the fake upstream counts words + 8
    assert delta("kvgate_tokens_total", kind="prompt", model=MODEL) == 2 * usage["prompt_tokens"] + streamed_prompt
    assert delta("kvgate_tokens_total", kind="completion", model=MODEL) > 2 * usage["completion_tokens"]
    # The upstream reports no cache reads: its uncached prompt tokens count as cache creation.
    assert delta("kvgate_tokens_total", kind="cache_creation", model=MODEL) == usage["prompt_tokens"] + streamed_prompt
    assert delta("kvgate_saved_tokens_total", source="response_cache") == (
        usage["prompt_tokens"] + usage["completion_tokens"])
    assert delta("kvgate_saved_cost_dollars_total", source="response_cache") > 0

    assert delta("kvgate_request_duration_seconds_count", route=route, cache="miss") == 2
    assert delta("kvgate_time_to_first_token_seconds_count", route=route, cache="hit-exact") == 1
    assert value(after, "kvgate_upstream_up", upstream="fake") == 1
    assert value(after, "kvgate_upstream_in_flight_requests", upstream="fake") == 0
    assert ("kvgate_request_log_dropped_rows_total", ()) in after


def test_errors_are_counted_by_status(obs_gateway: Gateway) -> None:
    before = scrape(obs_gateway)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "fail please"}], "fake_fault": "status:500",
            "temperature": 0}
    response = httpx.post(obs_gateway.v1 + "/chat/completions", json=body, timeout=30,
                          headers={"authorization": f"Bearer {obs_gateway.api_key}"})
    assert response.status_code == 500
    missing = httpx.post(obs_gateway.v1 + "/chat/completions", json={**body, "model": "no-such-model"}, timeout=30,
                         headers={"authorization": f"Bearer {obs_gateway.api_key}"})
    assert missing.status_code == 404
    after = scrape(obs_gateway)
    statuses = {labels: v - before.get((name, labels), 0.0) for (name, labels), v in after.items()
                if name == "kvgate_requests_total"}
    assert statuses[(("cache", "miss"), ("route", "chat.completions"), ("status", "500"))] == 1
    assert any(dict(labels)["status"] == "404" and n == 1 for labels, n in statuses.items())
    # A client's unknown model never becomes a label.
    assert not any("no-such-model" in str(key) for key in after)


def test_kv_tier_metrics_come_from_the_manager_at_scrape_time() -> None:
    layout = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
    settings = KVCacheSettings(block_size=4, device="cpu", device_capacity_bytes=0, host_capacity_bytes=1 << 20,
                               host_codec="shrink-zstd")
    kv = build_manager(settings, model_id="m", layout=layout)
    try:
        tokens = list(range(16))
        kv.store("salt", tokens, torch.zeros(2, 2, 2, 16, 8, dtype=torch.bfloat16))
        kv.load(kv.lookup("salt", tokens))
        engine = SimpleNamespace(kv=kv, worker=SimpleNamespace(num_pending=3))
        text = bytes(engine_metrics_response(engine).body).decode()  # type: ignore[arg-type]
    finally:
        kv.close()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("kvgate_engine_queue_requests", ())] == 3
    assert samples[("kvgate_kv_tier_blocks", (("tier", "host"),))] == 4
    assert samples[("kvgate_kv_tier_used_bytes", (("tier", "host"),))] > 0
    assert samples[("kvgate_kv_tier_capacity_bytes", (("tier", "host"),))] == 1 << 20
    assert samples[("kvgate_kv_tier_hits_total", (("tier", "host"),))] == 4
    assert samples[("kvgate_kv_tier_written_bytes_total", (("tier", "host"),))] > 0
    assert samples[("kvgate_kv_tier_admission_rejects_total", (("tier", "host"),))] == 0
    assert samples[("kvgate_kv_hit_tokens_total", ())] == 16
    # Zeros compress well: the shrink codec stores far fewer bytes than the raw blocks.
    assert samples[("kvgate_kv_codec_ratio", (("tier", "host"),))] > 2


MULTIPROCESS_WORKER = textwrap.dedent("""
    import sys
    from gateway.observability.metrics import Metrics
    from gateway.observability.settings import ObservabilitySettings
    from gateway.persistence.request_log import RequestRecord
    from gateway.usage.settings import UsageSettings

    metrics = Metrics(ObservabilitySettings(), UsageSettings().price_for)
    for i in range(int(sys.argv[1])):
        metrics.observe(RequestRecord(request_id=str(i), tenant="t", route="chat.completions", model="m",
                                      status=200, total_ms=5.0, ttfb_ms=1.0, prompt_tokens=10, cache="miss"))
    if sys.argv[2] == "print":
        sys.stdout.write(metrics.exposition().decode())
""")


def test_several_worker_processes_are_summed(tmp_path: Path, repo_root: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    run = [sys.executable, "-c", MULTIPROCESS_WORKER]
    subprocess.run([*run, "2", "quiet"], env=env, cwd=repo_root, check=True)
    out = subprocess.run([*run, "3", "print"], env=env, cwd=repo_root, check=True, capture_output=True, text=True)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(out.stdout) for s in f.samples}
    labels = (("cache", "miss"), ("route", "chat.completions"), ("status", "200"))
    assert samples[("kvgate_requests_total", labels)] == 5
    assert samples[("kvgate_tokens_total", (("kind", "prompt"), ("model", "m")))] == 50
