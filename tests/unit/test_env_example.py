"""`.env.example` lists every setting, and nothing that is not one."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from gateway.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def setting_names(model: type[BaseModel], prefix: str = "KVGATE_") -> set[str]:
    """Every environment variable of the settings tree: top-level fields, and the fields of each
    subsystem's model (one level down; a model deeper than that is one JSON value)."""
    names = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if prefix == "KVGATE_" and isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names |= setting_names(annotation, f"{prefix}{name.upper()}__")
        else:
            names.add(f"{prefix}{name.upper()}")
    return names


COMPOSE_ONLY = "# --- docker-compose only"


def listed_names(compose_only: bool) -> set[str]:
    text = (ROOT / ".env.example").read_text()
    settings_part, _, compose_part = text.partition(COMPOSE_ONLY)
    part = compose_part.split("\n", 1)[1] if compose_only else settings_part
    return {line.split("=", 1)[0] for line in part.splitlines() if line and not line.startswith("#")}


def test_env_example_lists_every_setting() -> None:
    lines = (ROOT / ".env.example").read_text().splitlines()
    assert listed_names(compose_only=False) == setting_names(Settings)
    for i, line in enumerate(lines):
        if line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"{line.split('=')[0]} has no comment line"


def test_env_example_lists_each_setting_once() -> None:
    names = [line.split("=", 1)[0] for line in (ROOT / ".env.example").read_text().splitlines()
             if line and not line.startswith("#")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


FULL_REFERENCE = "# === Full reference"


def test_env_example_opens_with_what_most_users_change() -> None:
    """The settings a newcomer changes first (upstreams, the admin key, the database, the response
    cache, the engine's token cap) come first, before a line pointing at the full reference
    (issue 44, item 5)."""
    text = (ROOT / ".env.example").read_text()
    first, marker, _ = text.partition(FULL_REFERENCE)
    assert marker, f"no {FULL_REFERENCE!r} line"
    names = {line.split("=", 1)[0] for line in first.splitlines() if line and not line.startswith("#")}
    assert {"KVGATE_UPSTREAM", "KVGATE_UPSTREAMS", "KVGATE_ADMIN_KEY", "KVGATE_DATABASE_URL",
            "KVGATE_RESPONSECACHE__ENABLED", "KVGATE_RESPONSECACHE__SEMANTIC",
            "KVGATE_ENGINE__DEFAULT_MAX_TOKENS"} <= names
    assert len(names) <= 12, "the first group is the few settings most users change, not a second reference"


def test_env_example_values_are_valid(tmp_path: Path) -> None:
    """Its values, read the way a user's `.env` is read, give a valid configuration."""
    settings = Settings(_env_file=ROOT / ".env.example")
    assert settings.port == 8080 and settings.database_url.startswith("sqlite+aiosqlite")
