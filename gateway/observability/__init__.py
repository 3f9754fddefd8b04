"""Observability: Prometheus metrics (`metrics.py`, every metric kvgate exports), structured logs
with request ids (`logging.py`, `middleware.py`), the dashboard and its data API (`routes.py`,
`static/`), and the request-log summary behind the dashboard and `kvgate stats` (`summary.py`).

Several worker processes: set `PROMETHEUS_MULTIPROC_DIR` to an empty directory before starting
them (clear it on every start); `/metrics` then sums request metrics over all workers.
"""
