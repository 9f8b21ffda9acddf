# Two commands on a fresh machine:  `make demo`  and  `make test-all`.
# `make demo` installs the project alone (what the learner and the server need); the test
# targets add the [dev] extra (pytest, linters, fuzzing, the optional integrations under test).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# The CPU build, from PyTorch's own CPU index: PyPI's Linux wheel is the CUDA build (GBs of CUDA
# libraries). A GPU machine: make venv TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: venv demo test test-all fuzz lint format gpu-check clean

# torch alone from its index (--no-deps): its own dependencies come from PyPI with the project's.
$(BIN)/.base: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-deps "$(TORCH)" --index-url "$(TORCH_INDEX)"
	$(BIN)/pip install -q -e .
	touch $@

$(BIN)/.installed: $(BIN)/.base
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

venv: $(BIN)/.installed

demo: $(BIN)/.base
	rm -rf runs/demo  # each demo starts afresh (a run refuses a directory holding another)
	$(BIN)/python -m learner --config learner/configs/demo.toml --run-dir runs/demo
	$(BIN)/python -m learner plot runs/demo

# pytest-xdist: one worker per core (at most 4: each loads torch and tiny models); whole files go
# to one worker, so a file's module-scoped fixtures (a server, a model) are built once.
# `make test` is the everyday loop: lint and every CPU test but the end-to-end runs marked slow
# (over ~20 s each); `make test-all` runs every CPU test, slow ones included: what CI runs.
PYTEST = $(BIN)/python -m pytest -q --durations=15 -n auto --maxprocesses 4 --dist loadfile

test: venv lint
	$(PYTEST) -m "not gpu and not slow"

test-all: venv lint
	$(PYTEST) -m "not gpu"

# Property-based fuzzing of the rollout server's whole OpenAPI (schemathesis, stateful chains
# included) against a real server on loopback under a memory cap; docs/api.md says what it checks.
fuzz: venv
	timeout 900 $(BIN)/python tests/fuzz/run_fuzz.py

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports --no-logo

format: venv
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache .import_linter_cache
