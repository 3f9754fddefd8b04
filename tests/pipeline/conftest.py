from tests.api.conftest import database_url, fake_anthropic, gw  # noqa: F401  (the same gateway fixtures)
