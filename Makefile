# Developer tasks. Every target runs from the repository root with the project's virtualenv
# (PY=... to use another one). `make check` is what a change must pass before review.
PY ?= .venv/bin/python
RUFF ?= $(PY) -m ruff
MYPY ?= $(PY) -m mypy

.PHONY: lint types test test-one check bench-overhead fmt

lint:  ## ruff: style, imports, complexity (C901, max-complexity in pyproject.toml)
	$(RUFF) check gateway tests bench migrations

fmt:  ## ruff's safe fixes (import order, pyupgrade)
	$(RUFF) check --fix gateway tests bench migrations

types:  ## mypy on the package
	$(MYPY) gateway

test:  ## the whole suite (needs PostgreSQL and Redis on 127.0.0.1; several minutes)
	$(PY) -m pytest -q

test-one:  ## one test file or node: make test-one T=tests/upstream/test_router.py
	$(PY) -m pytest -q $(T)

check: lint types  ## lint + types (then the tests of what you touched)

bench-overhead:  ## what the gateway adds over a bare FastAPI proxy (and LiteLLM, when installed)
	$(PY) -m gateway bench overhead --no-litellm
