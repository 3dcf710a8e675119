# flashlab: `make lab` opens the notebooks, `make test` runs everything CI runs.
# Both create the virtual environment in .venv on first use (re-installing when pyproject.toml changes).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flashlab-installed
# CI sets TORCH_SPEC=torch==2.13.0 to take a small CPU-only torch; left empty, pip takes PyPI's normal torch.
TORCH_SPEC ?=
# JupyterLab refuses to run as root unless told to (containers, CI).
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab test lint format install clean

lab: $(STAMP)
	$(BIN)/jupyter lab $(ROOT_FLAG) notebooks/

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(if $(TORCH_SPEC),$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)")
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis test-artifacts
