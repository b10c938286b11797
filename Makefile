# Development entry points. Every target that runs code creates .venv on first use:
# torch pinned first (the torch==2.13.0 build that pip finds: a local CPU build where pip is
# configured with one, as on the development machine), then this package with its dev
# extras. The stamp file makes later runs skip the install until pyproject.toml changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: venv demo test lint format clean distclean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install "$(TORCH)"
	$(BIN)/python -m pip install -e ".[dev]"
	touch $(STAMP)

# Extra flags go through ARGS, e.g. make demo ARGS="--fault exception:0@30".
demo: venv
	$(BIN)/phalanx demo $(ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

# Rewrites files: ruff's import sorting and formatting.
format: venv
	$(BIN)/ruff check --select I --fix .
	$(BIN)/ruff format .

clean:
	rm -rf runs build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
