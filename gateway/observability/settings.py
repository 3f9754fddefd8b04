"""Settings of metrics, logs and the dashboard (`KVGATE_OBSERVABILITY__*`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, SecretStr


class ObservabilitySettings(BaseModel):
    # Serve Prometheus metrics at /metrics.
    metrics_enabled: bool = True
    # /metrics answers without a key. Off (the default), it asks for the admin key or `metrics_key`:
    # its figures (tenants, models, traffic, spend) are not for whoever can reach the API port.
    metrics_public: bool = False
    # A key that opens /metrics and nothing else: what Prometheus scrapes with (its
    # `authorization: {credentials_file: ...}`), so that the scraper holds no admin key.
    metrics_key: SecretStr | None = None
    # Serve the dashboard at /dashboard and its data API (admin key only).
    dashboard_enabled: bool = True
    # Log lines as JSON objects (one per line) or as plain text.
    log_format: Literal["json", "text"] = "json"
    # One log line per finished HTTP request (method, path, status, duration, request id).
    access_log: bool = True
    # Most request-log rows one dashboard or `kvgate stats` summary reads (newest first).
    summary_max_rows: int = Field(default=200_000, gt=0)
    # Prefix breaks kept in memory for the dashboard's "recent prefix breaks" table.
    recent_prefix_breaks: int = Field(default=100, gt=0)
