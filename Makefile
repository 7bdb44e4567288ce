# One command to run Pylon in front of the built-in mock engine, one to run every check.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# checkov pins ~80 packages of its own, so it lives in a separate venv.
CHECKOV_VENV := .tools/checkov
TEST_PATH := $(CURDIR)/$(BIN):$(PATH):$(CURDIR)/$(CHECKOV_VENV)/bin

# Pylon on an interpreter built with PGO and LTO, as the container's
# (python:3.11-slim) is; Debian's python3.11 is one (apt-get install -y
# python3.11-venv). For benches: docs/performance.md, "The interpreter".
OPTIMIZED_PYTHON ?= /usr/bin/python3.11
OPTIMIZED_VENV ?= .venv-optimized

# $(1): the interpreter, $(2): the venv it makes, with the locked dependency set.
define locked_venv
	$(1) -m venv $(2)
	$(2)/bin/pip install --quiet --upgrade pip
	$(2)/bin/pip install --quiet -c requirements.lock -e ".[dev,bench]"
endef

.PHONY: install tools run test lint typecheck pytest lock optimized-venv

$(BIN)/.installed: pyproject.toml requirements.lock
	$(call locked_venv,$(PYTHON),$(VENV))
	touch $@

$(OPTIMIZED_VENV)/.installed: pyproject.toml requirements.lock
	$(call locked_venv,$(OPTIMIZED_PYTHON),$(OPTIMIZED_VENV))
	touch $@

$(CHECKOV_VENV)/.installed: requirements-checkov.lock
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet --upgrade pip
	$(CHECKOV_VENV)/bin/pip install --quiet -r requirements-checkov.lock
	touch $@

install: $(BIN)/.installed

tools: $(CHECKOV_VENV)/.installed

optimized-venv: $(OPTIMIZED_VENV)/.installed

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
