"""Reading the condense options from headers, the body and the settings."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidField
from gateway.pipeline.condense import CondenseRequest, read_condense
from gateway.pipeline.settings import CondenseSettings

SETTINGS = CondenseSettings(ratio=3.0, min_tokens=400, tenants=["rag-team"], models=["big-model"])


def test_off_unless_asked() -> None:
    assert read_condense({}, {"model": "m"}, SETTINGS, "t", "m") is None


def test_body_option_is_removed_and_read() -> None:
    body = {"model": "m", "kvgate": {"condense": {"ratio": 2, "min_tokens": 50}}}
    assert read_condense({}, body, SETTINGS, "t", "m") == CondenseRequest(2.0, 50)
    assert "kvgate" not in body
    body = {"model": "m", "kvgate": {"condense": True, "cache": {"no_store": True}}}
    assert read_condense({}, body, SETTINGS, "t", "m") == CondenseRequest(3.0, 400)
    assert body["kvgate"] == {"cache": {"no_store": True}}


def test_header_wins_and_carries_a_ratio() -> None:
    body = {"kvgate": {"condense": True}}
    assert read_condense({"x-kvgate-condense": "off"}, body, SETTINGS, "t", "m") is None
    assert read_condense({"x-kvgate-condense": "5"}, {}, SETTINGS, "t", "m") == CondenseRequest(5.0, 400)


def test_tenant_and_model_settings_turn_it_on() -> None:
    assert read_condense({}, {}, SETTINGS, "rag-team", "m") == CondenseRequest(3.0, 400)
    assert read_condense({}, {}, SETTINGS, "t", "big-model") == CondenseRequest(3.0, 400)
    assert read_condense({}, {"kvgate": {"condense": False}}, SETTINGS, "rag-team", "m") is None


@pytest.mark.parametrize(("headers", "body"), [
    ({"x-kvgate-condense": "0.5"}, {}),
    ({"x-kvgate-condense": "lots"}, {}),
    ({}, {"kvgate": {"condense": {"ratio": 100}}}),
    ({}, {"kvgate": {"condense": {"rate": 2}}}),
    ({}, {"kvgate": {"condense": "yes"}}),
    ({}, {"kvgate": {"condense": {"min_tokens": 0}}}),
])
def test_bad_options_are_422(headers: dict[str, str], body: dict) -> None:
    with pytest.raises(InvalidField) as raised:
        read_condense(headers, body, SETTINGS, "t", "m")
    assert raised.value.status_code == 422
