# The whole set-up lives here: `make test` and `make serve` work on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test serve soak lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

serve: $(STAMP)
	$(BIN)/cellserve serve $(ARGS)

soak: $(STAMP)
	$(BIN)/python -m pytest -m 'soak or soak_long' -o addopts='-q' tests/test_soak.py

lint: $(STAMP)
	$(BIN)/ruff check engine server tests

clean:
	rm -rf $(VENV)
