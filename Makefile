# Two commands for users: `make train` and `make test`. Both create .venv on first use,
# installing the pinned, tested stack from constraints.txt (Python 3.11, jax 0.10.2).
# `make test-py312` runs, on the second tested stack (constraints-py312.txt: Python 3.12, jax 0.12.0.1)
# in .venv-py312, the tests marked `both_stacks` -- what differs between JAX versions: every pipeline
# schedule, the deadlock proof and stress test, 1-bit LAMB, checkpoints and fine-tuning from them,
# multi-process, generation, attention, Linen models, the upstream XLA reproduction -- and of a matrix
# of meshes (every schedule on every mesh), the representative cases (the rest are marked
# `first_stack_only`), and the tests marked `gpu_compile` (every feature compiled for 8 compile-only
# H100s; the stack's gpu-compile extra), so that both legs of .ci/run fit CI's time; `make test-py312 PY312_TESTS=tests`
# runs all of it. `make test-fast` runs the suite without the tests marked `slow` (the end-to-end
# runs), in a few minutes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.meshtron-installed
TEST_STAMP := $(VENV)/.meshtron-test-extras
PY312 ?= $(shell .ci/python312)
VENV312 := .venv-py312
STAMP312 := $(VENV312)/.meshtron-installed
PY312_SELECTION := (both_stacks and not first_stack_only) or gpu_compile
PY312_TESTS ?= -m "($(PY312_SELECTION))$(if $(TEST_MARKERS), and ($(TEST_MARKERS)),)" tests

.PHONY: train test test-fast test-py312 bench lint clean

# pip byte-compiles what it installs (about 40 CPU seconds for the test environment's 22,000 .py files),
# and that stays: where PYTHONDONTWRITEBYTECODE is set (as in this project's machine image) Python writes
# no .pyc at import, so every process -- each test worker, each CLI run a test starts -- would compile
# the modules it imports again (jax, torch, transformers and the trackers: 15 CPU seconds, not 6).
PIP_INSTALL := -m pip install --quiet --disable-pip-version-check

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python $(PIP_INSTALL) -c constraints.txt -e ".[dev]"
	touch $(STAMP)

# The tests also compare against Hugging Face's own models (the `hf` extra: transformers + a CPU torch,
# about 1 GB, installed from this image's local torch wheel), run `meshtron eval` against lm-eval's Hugging
# Face backend (the `eval` extra), read back what the experiment trackers wrote (the `wandb` and `mlflow`
# extras) and read streamed data (the `hf-data` and `grain` extras): `make test` only, not `make train`.
# One pip run installs everything `make test` needs, `make train`'s part included (a second run would
# resolve the whole stack and rebuild the editable install again).
$(TEST_STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python $(PIP_INSTALL) -c constraints.txt -e ".[dev,hf,eval,wandb,mlflow,hf-data,grain]"
	touch $(STAMP) $(TEST_STAMP)

train: $(STAMP)
	$(BIN)/meshtron train --config mesh_configs/cpu8.yaml $(ARGS)

# Two pytest workers (pytest-xdist; each takes the next test when it is done, `worksteal`): a test
# here spends much of its time in XLA's compiler, which uses one core, so one pytest process leaves
# the second core of a 2-core machine idle (two workers take about two thirds of one's time). Both
# workers share tests/conftest.py's compilation cache. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

# TEST_MARKERS: a pytest marker expression the suite is narrowed to (.ci/run: "not extended", the tier
# CI runs within its time); empty, the default: the whole suite.
TEST_MARKERS ?=

# tests/run_suite.py runs the suite in two pytest sessions on this stack's jaxlib: all but the tests
# marked `fusion_emitters` with XLA:CPU's faster-compiling element-wise emitters, then those with XLA's
# defaults (its docstring says why). pytest's "no tests collected" (exit 5) in both is a failure.
test: $(TEST_STAMP)
	$(BIN)/python tests/run_suite.py "$(TEST_MARKERS)" $(XDIST) $(PYTEST_ARGS)

test-fast: $(TEST_STAMP)
	$(BIN)/python tests/run_suite.py "not slow" $(XDIST) $(PYTEST_ARGS)

$(STAMP312): pyproject.toml constraints-py312.txt
	@test -n "$(PY312)" || { echo "make test-py312: no Python 3.12 found (pyenv's versions, or python3.12 on PATH)" >&2; exit 1; }
	test -x $(VENV312)/bin/python || $(PY312) -m venv $(VENV312)
	$(VENV312)/bin/python $(PIP_INSTALL) -c constraints-py312.txt -e ".[dev,gpu-compile]"
	touch $(STAMP312)

test-py312: $(STAMP312)
	$(VENV312)/bin/python -m pytest -q $(XDIST) $(PY312_TESTS) $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test-py312: pytest collected no tests" >&2; exit 1; fi; exit $$rc

bench: $(STAMP)
	$(BIN)/python benchmarks/comm_volume.py
	$(BIN)/python benchmarks/throughput.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) $(VENV312) build src/*.egg-info
