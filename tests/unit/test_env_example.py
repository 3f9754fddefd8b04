"""`.env.example` lists every setting, and nothing that is not one."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from gateway.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def setting_names(model: type[BaseModel], prefix: str = "KVGATE_") -> set[str]:
    names = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names |= setting_names(annotation, f"{prefix}{name.upper()}__")
        else:
            names.add(f"{prefix}{name.upper()}")
    return names


def test_env_example_lists_every_setting() -> None:
    lines = (ROOT / ".env.example").read_text().splitlines()
    listed = {line.split("=", 1)[0] for line in lines if line and not line.startswith("#")}
    assert listed == setting_names(Settings)
    for i, line in enumerate(lines):
        if line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"{line.split('=')[0]} has no comment line"


def test_env_example_values_are_valid(tmp_path: Path) -> None:
    """Its values, read the way a user's `.env` is read, give a valid configuration."""
    settings = Settings(_env_file=ROOT / ".env.example")
    assert settings.port == 8080 and settings.database_url.startswith("sqlite+aiosqlite")
