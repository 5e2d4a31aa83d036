# Two entry points on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
SYS_STAMP := $(VENV)/.system-deps

.PHONY: serve test lint gpu-test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned to the CPU wheel that lies on this kind of machine; bigvgan without its
# training extras (librosa, pesq, tensorboard...): we only use its generator class.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps bigvgan==2.4.1
	touch $@

$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# System packages the tests use: Chromium for the browser test, espeak-ng and sox for speech samples.
$(SYS_STAMP): | $(BIN)/python
	@if command -v chromium >/dev/null && command -v espeak-ng >/dev/null && command -v sox >/dev/null; then :; \
	else (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      chromium espeak-ng sox fonts-dejavu-core >/dev/null) || (sudo apt-get update -qq && \
	      sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium espeak-ng sox fonts-dejavu-core >/dev/null); fi
	touch $@

serve: $(STAMP)
	$(BIN)/moss-speech serve --model tiny-random --codec tiny-random --host $${HOST:-127.0.0.1} --port $${PORT:-8000}

test: $(DEV_STAMP) $(SYS_STAMP)
	$(BIN)/ruff check engines server tests moss_speech client_web
	$(BIN)/python -m pytest -q tests --ignore=tests/gpu

lint: $(DEV_STAMP)
	$(BIN)/ruff check engines server tests moss_speech client_web

# On a GPU machine that has only PyTorch: no venv needed.
gpu-test:
	$(PY) -m pytest -q -p no:cacheprovider tests/gpu

clean:
	rm -rf $(VENV)
