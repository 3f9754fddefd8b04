"""Limits on keys and tenants: requests and tokens per minute, concurrent requests, and a spend
budget per period (gateway/limits/gate.py)."""
