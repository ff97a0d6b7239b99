# Two commands for users: `make train` and `make test`. Both create .venv on first use,
# installing the pinned, tested stack from constraints.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.meshtron-installed

.PHONY: train test bench lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/meshtron train --config mesh_configs/cpu8.yaml $(ARGS)

# pytest exits 5 when it collects no tests: that is a failure, not a pass.
test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

bench: $(STAMP)
	$(BIN)/python benchmarks/comm_volume.py
	$(BIN)/python benchmarks/throughput.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build src/*.egg-info
