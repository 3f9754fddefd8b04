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


def test_env_example_values_are_valid(tmp_path: Path) -> None:
    """Its values, read the way a user's `.env` is read, give a valid configuration."""
    settings = Settings(_env_file=ROOT / ".env.example")
    assert settings.port == 8080 and settings.database_url.startswith("sqlite+aiosqlite")
