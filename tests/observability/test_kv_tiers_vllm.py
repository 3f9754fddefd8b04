"""The dashboard's rows for kvgate's connector inside vLLM, read off vLLM's /metrics text."""

from __future__ import annotations

from gateway.observability.kv_tiers import connector_rows

METRICS = """# HELP vllm:kvgate_tier_blocks kvgate connector: blocks held in each bounded tier.
# TYPE vllm:kvgate_tier_blocks gauge
vllm:kvgate_tier_blocks{engine="0",model_name="m",tier="host"} 42.0
vllm:kvgate_tier_blocks{engine="0",model_name="m",tier="disk"} 7.0
# HELP vllm:kvgate_tier_used_bytes kvgate connector: bytes held in each bounded tier.
# TYPE vllm:kvgate_tier_used_bytes gauge
vllm:kvgate_tier_used_bytes{engine="0",model_name="m",tier="host"} 3.1e+07
vllm:kvgate_tier_used_bytes{engine="0",model_name="m",tier="disk"} 2.0e+06
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_connector_tiers_are_read_off_vllm_metrics() -> None:
    rows = {r["name"]: r for r in connector_rows("vllm-1", METRICS)}
    assert rows == {
        "vllm-1: host": {"name": "vllm-1: host", "up": True, "num_blocks": 42, "used_bytes": 31_000_000},
        "vllm-1: disk": {"name": "vllm-1: disk", "up": True, "num_blocks": 7, "used_bytes": 2_000_000},
    }


def test_a_server_without_the_connector_adds_no_row() -> None:
    assert connector_rows("vllm-1", METRICS.split("# HELP vllm:num_requests_running")[0][:0]) == []
