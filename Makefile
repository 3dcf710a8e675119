# flashlab: `make lab` opens your own copies of the notebooks, `make test` runs everything CI runs.
# Both create the virtual environment in .venv on first use (re-installing when pyproject.toml or the pinned
# versions in requirements/ci-constraints.txt change).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flashlab-installed
# The exact versions CI ran, for every package but torch and triton (whose builds depend on the platform).
# `make test CONSTRAINTS=` installs without them (newest versions that fit pyproject.toml), e.g. if a newer torch
# you chose needs newer versions of its dependencies than CI ran.
CONSTRAINTS ?= requirements/ci-constraints.txt

# Which torch to install. Left empty, pip takes whatever build its index serves for `torch>=2.4`: on Linux x86_64
# PyPI serves a CUDA build (several GB with its NVIDIA libraries), even on a machine without a GPU.
#   TORCH_INDEX  a package index that holds the torch build you want; torch alone is installed from it, e.g.
#                make test TORCH_INDEX=https://download.pytorch.org/whl/cpu   (PyTorch's CPU-only builds)
#   TORCH_SPEC   a version requirement for that install, e.g. torch==2.13.0. A plain pin chooses a version, not
#                a build: from PyPI it is still the CUDA build. CI's CPU build comes from a wheel that lies on
#                its own machine's disk (.ci/run).
TORCH_SPEC  ?=
TORCH_INDEX ?=

# Your working copies of the notebooks: made from notebooks/ on first use, never overwritten, ignored by git.
WORK ?= my-notebooks
NB   ?=

# JupyterLab refuses to run as root unless told to (containers, CI).
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab copies reset test lint format install constraints clean

# JupyterLab's settings for the lab (jupyter/lab-settings/overrides.json): no news feed and no update check, whose
# first-start question would cover a corner of the notebooks' widgets. Settings you change in JupyterLab still win.
LAB_SETTINGS := jupyter/lab-settings

lab: $(STAMP) copies
	$(BIN)/jupyter lab $(ROOT_FLAG) --LabApp.app_settings_dir=$(CURDIR)/$(LAB_SETTINGS) $(WORK)/

# Copy every notebook that is missing from $(WORK)/; a copy that exists is yours and is left alone.
copies:
	@mkdir -p $(WORK)
	@for nb in notebooks/[0-9][0-9]_*.ipynb; do \
	    copy="$(WORK)/$${nb#notebooks/}"; \
	    if [ ! -e "$$copy" ]; then cp "$$nb" "$$copy" && echo "new working copy: $$copy"; fi; \
	done
	@echo "Your notebooks are in $(CURDIR)/$(WORK)/ (git ignores them; notebooks/ stays as committed)."

# Start one notebook again from its committed version: make reset NB=03 (a notebook of notebooks/ by its number or
# name, no path). Your old copy is kept in $(WORK)/.before-reset/: the first as it was named, later ones numbered
# (03_....-2.ipynb, -3, ...), none ever replaced.
reset:
	@test -n "$(NB)" || { echo "say which notebook to reset, e.g. make reset NB=03"; exit 2; }
	@case '$(NB)' in *[!A-Za-z0-9_-]*) \
	    echo "NB=$(NB): name a notebook of notebooks/ by its number or name only, e.g. NB=03 (no path)"; exit 2;; \
	esac
	@set -- notebooks/$(NB)*.ipynb; \
	if [ ! -e "$$1" ] || [ $$# -ne 1 ]; then \
	    echo "NB=$(NB) must name exactly one notebook in notebooks/; it matches: $$*"; exit 2; fi; \
	name="$${1#notebooks/}"; copy="$(WORK)/$$name"; keep="$(WORK)/.before-reset/$$name"; \
	mkdir -p "$(WORK)/.before-reset"; \
	if [ -e "$$copy" ]; then \
	    n=1; while [ -e "$$keep" ]; do n=$$((n + 1)); keep="$(WORK)/.before-reset/$${name%.ipynb}-$$n.ipynb"; done; \
	    mv "$$copy" "$$keep" && echo "your previous copy: $$keep"; fi; \
	cp "$$1" "$$copy" && echo "reset: $$copy is the committed $$1 again"

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest

install: $(STAMP)

# torch first when a spec or an index is given (torch alone: its dependencies then come from PyPI under the pins),
# then flashlab with its test tools, every version pinned by $(CONSTRAINTS).
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(if $(TORCH_SPEC)$(TORCH_INDEX),$(BIN)/python -m pip install --quiet --no-deps \
	    $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(or $(TORCH_SPEC),torch)")
	$(BIN)/python -m pip install --quiet $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[test]"
	echo "pinned by: $(or $(CONSTRAINTS),nothing)" > $@

# Re-record the pins from this environment: run it where CI's install ran (a fresh clone, `TORCH_SPEC=torch==2.13.0
# make install`), then commit the file. torch and triton go in as comments: CI's builds, not pins.
constraints: $(STAMP)
	test -n "$(CONSTRAINTS)"
	{ sed -n '1,/^# ---/p' $(CONSTRAINTS); \
	  $(BIN)/python -m pip freeze --exclude-editable | grep -i -E '^(torch|triton)==' | sed 's/^/# ci ran, not pinned: /'; \
	  $(BIN)/python -m pip freeze --exclude-editable | grep -v -i -E '^(torch|triton)==' | grep -v '^#'; \
	} > $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Remove what is rebuilt on demand: the environment, the tools' caches and what the tests write in test-artifacts/.
# The CPU benchmark's results in test-artifacts/bench/ are kept (delete them yourself if you mean to).
clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
	@if [ -d test-artifacts ]; then find test-artifacts -mindepth 1 -maxdepth 1 ! -name bench -exec rm -rf {} +; fi
