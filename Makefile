# One command to run Pylon in front of the built-in mock engine, one to run every check.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install run test lint typecheck pytest lock

$(BIN)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c requirements.lock -e ".[dev]"
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/pylon serve --dev

lint: install
	$(BIN)/ruff check pylon tunnel backends tests bench
	$(BIN)/ruff format --check pylon tunnel backends tests bench

typecheck: install
	$(BIN)/mypy

pytest: install
	$(BIN)/pytest

test: lint typecheck pytest

# Re-pin the tested dependency set after changing pyproject.toml.
lock: install
	$(BIN)/pip freeze --exclude-editable | grep -v '^-e' > requirements.lock
