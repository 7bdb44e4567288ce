# One command to run Pylon in front of the built-in mock engine, one to run every check.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# checkov pins ~80 packages of its own, so it lives in a separate venv.
CHECKOV_VENV := .tools/checkov
TEST_PATH := $(CURDIR)/$(BIN):$(PATH):$(CURDIR)/$(CHECKOV_VENV)/bin

.PHONY: install tools run test lint typecheck pytest lock

$(BIN)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c requirements.lock -e ".[dev]"
	touch $@

$(CHECKOV_VENV)/.installed: requirements-checkov.lock
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet --upgrade pip
	$(CHECKOV_VENV)/bin/pip install --quiet -r requirements-checkov.lock
	touch $@

install: $(BIN)/.installed

tools: $(CHECKOV_VENV)/.installed

run: install
	$(BIN)/pylon serve --dev

lint: install
	$(BIN)/ruff check pylon tunnel backends tests bench
	$(BIN)/ruff format --check pylon tunnel backends tests bench

typecheck: install
	$(BIN)/mypy

# Everything on the loop Pylon runs on by default (uvloop), then the end-to-end
# tests again on asyncio's own loop, the fallback (`event_loop = asyncio`).
pytest: install tools
	PATH="$(TEST_PATH)" $(BIN)/pytest
	PATH="$(TEST_PATH)" PYLON_EVENT_LOOP=asyncio $(BIN)/pytest -m e2e

test: lint typecheck pytest

# Re-pin the tested dependency sets after changing pyproject.toml.
lock: install tools
	$(BIN)/pip freeze --exclude-editable | grep -v '^-e' > requirements.lock
	$(CHECKOV_VENV)/bin/pip freeze > requirements-checkov.lock
