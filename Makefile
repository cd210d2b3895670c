# Two commands do all set-up on a fresh machine:
#   make run    -> installs into .venv, then runs the CLI on the built-in tiny model and a generated image
#   make test   -> installs into .venv, then runs the whole test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch 2.14.1 + torchvision 0.29.1 is the pairing that imports together on the project's machines
TORCH := torch==2.14.1 torchvision==0.29.1

.PHONY: setup run test lint bench

$(VENV)/.setup-stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.setup-stamp

run: setup
	$(BIN)/vtoken run $(ARGS)

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests $(or $(PYTEST_ARGS),-q)

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: setup
	$(BIN)/python benchmarks/bench_llava.py $(ARGS)
