"""Settings come from the environment with the KVGATE_ prefix, and are validated at start."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.settings import Settings, parse_upstream_flag


def test_env_upstreams_json_and_shorthand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_UPSTREAMS", '[{"name": "oai", "base_url": "https://api.openai.com/v1/", '
                                           '"api_key_env": "OPENAI_API_KEY", "models": ["gpt-4o"]}]')
    monkeypatch.setenv("KVGATE_UPSTREAM", "vllm=http://10.0.0.2:8000/v1, sglang=http://10.0.0.3:30000/v1")
    monkeypatch.setenv("KVGATE_PORT", "9000")
    settings = Settings(_env_file=None)
    assert [u.name for u in settings.upstreams] == ["oai", "vllm", "sglang"]
    assert settings.upstreams[0].base_url == "https://api.openai.com/v1"
    assert settings.upstreams[0].models == ["gpt-4o"]
    assert settings.port == 9000


def test_invalid_settings_fail_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_PORT", "not-a-port")
    with pytest.raises(ValidationError):
        Settings(_env_file=None)
    with pytest.raises(ValueError, match="NAME=BASE_URL"):
        parse_upstream_flag("no-equals-sign")
    with pytest.raises(ValidationError):
        parse_upstream_flag("x=ftp://nope")


def test_loopback_detection() -> None:
    assert Settings(_env_file=None, host="127.0.0.1").is_loopback()
    assert Settings(_env_file=None, host="::1").is_loopback()
    assert not Settings(_env_file=None, host="0.0.0.0").is_loopback()


def test_short_form_upstream_merges_by_name_one_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Env shorthand and --upstream share one rule: the short form's URL, the full form's details."""
    from gateway.upstream.settings import with_upstream

    monkeypatch.setenv("KVGATE_UPSTREAMS", '[{"name": "oai", "base_url": "https://a.example/v1", "models": ["m"]}]')
    monkeypatch.setenv("KVGATE_UPSTREAM", "oai=https://b.example/v1")
    settings = Settings(_env_file=None)
    assert [(u.name, u.base_url, u.models) for u in settings.upstreams] == [("oai", "https://b.example/v1", ["m"])]
    merged = with_upstream(settings.upstreams, parse_upstream_flag("oai=http://c.example/v1"))
    assert [(u.base_url, u.models) for u in merged] == [("http://c.example/v1", ["m"])]
    assert [u.name for u in with_upstream(merged, parse_upstream_flag("new=http://d/v1"))] == ["oai", "new"]


def test_no_auth_off_loopback_is_refused() -> None:
    with pytest.raises(ValueError, match="loopback"):
        Settings(_env_file=None, host="0.0.0.0", no_auth=True).check_no_auth()
    Settings(_env_file=None, host="127.0.0.1", no_auth=True).check_no_auth()
