"""`.env.example`, copied to `.env` as docs/deployment.md says, never switches off a cache tier that
compose turns on: each kvgate service's environment is resolved the way docker-compose resolves it
(env_file, then `environment:` entries interpolated from `.env`) and read into the real Settings."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from dotenv import dotenv_values

from gateway.kvcache.factory import tier_budgets
from gateway.settings import Settings
from tests.deploy.test_compose import PASSWORD, interpolate

# what a user's shell gives compose: the two required secrets
SHELL = {PASSWORD: "s3cret", "KVGATE_METRICS_KEY": "scrape"}

ROOT = Path(__file__).resolve().parents[2]
# docker-compose.yml alone and with each overlay the docs name.
STACKS = [
    ["docker-compose.yml"],
    ["docker-compose.yml", "deploy/compose.llama.yml"],
    ["docker-compose.yml", "deploy/compose.redis-cluster.yml"],
]
COMPOSE_DEFAULT = re.compile(r"\$\{(KVGATE_[A-Z0-9_]+):-([^}]*)\}")


def merged(files: list[str]) -> dict[str, dict[str, Any]]:
    """The services of `files`, later files merged over earlier ones (maps key by key, as compose)."""
    services: dict[str, dict[str, Any]] = {}
    for name in files:
        for service, spec in yaml.safe_load((ROOT / name).read_text())["services"].items():
            into = services.setdefault(service, {})
            for key, value in spec.items():
                if isinstance(value, dict) and isinstance(into.get(key), dict):
                    into[key] = {**into[key], **value}
                else:
                    into[key] = value
    return services


def resolved_environment(service: dict[str, Any], dotenv: dict[str, str]) -> dict[str, str]:
    """The container's environment: all of `.env` (the service's env_file), then its `environment:`
    entries, interpolated from `.env`; `environment:` wins."""
    environment = dict(dotenv) if "env_file" in service else {}
    environment |= {key: interpolate(str(value), dotenv) for key, value in (service.get("environment") or {}).items()}
    return environment


def tiers_in_force(environment: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Every cache tier and shared store these settings turn on, with its budget or URL."""
    with monkeypatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("KVGATE_")]:
            patch.delenv(key)
        for key, value in environment.items():
            patch.setenv(key, value)
        settings = Settings(_env_file=None)
    tiers: dict[str, object] = {}
    if settings.kvcache.enabled:
        tiers |= {f"kvcache.{name}": budget for name, budget in tier_budgets(settings.kvcache).items()}
    slots = settings.slots
    if slots.enabled:
        on = {"host": slots.host_mb, "disk": slots.disk_dir and slots.disk_mb, "redis": slots.redis_url}
        tiers |= {f"slots.{name}": value for name, value in on.items() if value}
    for name, url in (("responsecache.redis", settings.responsecache.redis_url),
                      ("limits.redis", settings.limits.redis_url)):
        if url:
            tiers[name] = url
    return tiers


def env_example() -> dict[str, str]:
    return {key: value or "" for key, value in dotenv_values(ROOT / ".env.example").items()}


@pytest.mark.parametrize("files", STACKS, ids=lambda files: "+".join(Path(f).stem for f in files))
def test_env_example_switches_off_no_tier_compose_turns_on(files: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Compose's own tiers are those of a `.env` holding only the password it requires; with all of
    `.env.example` (and that password) each service runs at least those tiers, with the same budgets."""
    example = env_example() | SHELL
    for name, service in merged(files).items():
        if "env_file" not in service:
            continue  # not a kvgate container
        compose_own = tiers_in_force(resolved_environment(service, SHELL), monkeypatch)
        with_example = tiers_in_force(resolved_environment(service, example), monkeypatch)
        switched_off = sorted(set(compose_own) - set(with_example))
        assert not switched_off, f"{name}: .env.example switches off {switched_off}"
        changed = {tier: (budget, with_example[tier]) for tier, budget in compose_own.items()
                   if with_example[tier] != budget}
        assert not changed, f"{name}: .env.example changes compose's {changed}"
    if files == ["docker-compose.yml"]:
        engine = tiers_in_force(resolved_environment(merged(files)["engine-1"], example), monkeypatch)
        assert {"kvcache.host", "kvcache.disk", "kvcache.redis"} <= set(engine), engine


def test_env_example_keeps_compose_defaults() -> None:
    """A variable compose reads as `${VAR:-default}` is blank in `.env.example` or holds that default,
    so the documented value is the one in force."""
    example = env_example()
    files = [ROOT / "docker-compose.yml", *sorted((ROOT / "deploy").glob("compose.*.yml"))]
    for path in files:
        for variable, default in COMPOSE_DEFAULT.findall(path.read_text()):
            value = example.get(variable, "")
            assert value in ("", default), f"{path.name}: .env.example sets {variable}={value}, compose: {default}"


def test_the_check_catches_a_tier_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old `.env.example` line (`DISK_CAPACITY_BYTES=0`) resolves to an engine without its disk tier."""
    engine = merged(["docker-compose.yml"])["engine-1"]
    dotenv = env_example() | SHELL | {"KVGATE_KVCACHE__DISK_CAPACITY_BYTES": "0"}
    assert "kvcache.disk" not in tiers_in_force(resolved_environment(engine, dotenv), monkeypatch)
