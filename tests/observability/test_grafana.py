"""The Grafana dashboard is valid JSON and queries only metrics kvgate defines."""

from __future__ import annotations

import re
from pathlib import Path

import orjson


def test_grafana_dashboard_uses_defined_metrics(repo_root: Path) -> None:
    dashboard = orjson.loads((repo_root / "deploy" / "grafana" / "kvgate.json").read_bytes())
    defined = (repo_root / "gateway" / "observability" / "metrics.py").read_text()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    for name in {n for e in exprs for n in re.findall(r"kvgate_[a-z_]+", e)}:
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert f'"{base}"' in defined, f"{name} is not defined in metrics.py"
