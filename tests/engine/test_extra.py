"""Without the `engine` extra, what needs the built-in engine says so in one line, naming the extra;
the gateway in front of an upstream never needs it (tests/unit/test_packaging.py runs that for real,
in an environment without torch)."""

from __future__ import annotations

import asyncio

import pytest

import gateway.engine.extra
from gateway.cli import main
from gateway.engine.settings import EngineSettings
from gateway.errors import ServiceUnavailable
from gateway.pipeline.condense import CondenseRequest, CondenseStep
from gateway.pipeline.settings import CondenseSettings


@pytest.fixture
def engine_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the extra were half installed: torch is here, one of its modules is not."""
    monkeypatch.setattr(gateway.engine.extra, "MODULES", ("torch", "kvgate_test_no_such_module"))


def test_installed_here() -> None:
    assert gateway.engine.extra.missing_modules() == []
    assert gateway.engine.extra.missing_message("anything") is None


def test_serve_without_upstream_and_engine_say_which_extra(engine_missing: None, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import uvicorn

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("a server started")

    monkeypatch.setattr(uvicorn, "run", started)
    monkeypatch.delenv("KVGATE_UPSTREAMS", raising=False)
    assert main(["serve", "--database-url", "sqlite+aiosqlite:///unused.db"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    # one line, after the one naming the database `serve` uses (every database command says it)
    assert lines[0].startswith("kvgate: database ") and len(lines) == 2
    err = lines[1]
    assert "kvgate_test_no_such_module missing" in err
    assert "pip install 'kvgate[engine]'" in err and "--upstream NAME=BASE_URL" in err
    assert main(["engine"]) == 2
    assert "pip install 'kvgate[engine]'" in capsys.readouterr().err


def test_condensing_without_the_engine_is_a_clear_503(engine_missing: None) -> None:
    step = CondenseStep(CondenseSettings(), EngineSettings())
    body = {"messages": [{"role": "user", "content": "word " * 500}, {"role": "user", "content": "question?"}]}
    with pytest.raises(ServiceUnavailable) as raised:
        asyncio.run(step.apply(body, CondenseRequest(ratio=3.0, min_tokens=10)))
    assert raised.value.code == "condense_unavailable"
    assert raised.value.message.startswith("condensing needs the built-in engine")
    assert "pip install 'kvgate[engine]'" in raised.value.message
