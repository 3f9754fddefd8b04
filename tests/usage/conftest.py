from tests.api.conftest import fake_anthropic, gw  # noqa: F401  (the same gateway fixtures)
