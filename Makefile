# Two commands do all set-up on a fresh machine:
#   make run    -> installs into .venv, then runs the CLI on vtoken-mini and a generated scene
#   make test   -> installs into .venv everything the tests need (all extras, a browser), then runs the whole
#                  test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch 2.14.1 + torchvision 0.29.1 is the pairing that imports together on the project's machines
TORCH := torch==2.14.1 torchvision==0.29.1

.PHONY: setup test-setup browser run test lint bench

$(VENV)/.setup-stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

# the tests also cover lmms-eval, the Gradio demo in a real browser, timm/open_clip towers and Triton kernels
$(VENV)/.test-stamp: $(VENV)/.setup-stamp pyproject.toml
	$(BIN)/pip install -q -e ".[all]"
	touch $@

setup: $(VENV)/.setup-stamp

test-setup: $(VENV)/.test-stamp browser

# Debian's chromium for the browser test (playwright's own browser download cannot work offline)
browser:
	@if [ -x /usr/lib/chromium/chromium ] || command -v chromium >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; \
	else echo "no chromium and no apt-get: install a Chromium browser for tests/test_demo_browser.py" >&2; fi

run: setup
	$(BIN)/vtoken run $(ARGS)

test: test-setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests $(or $(PYTEST_ARGS),-q)

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: setup
	$(BIN)/python benchmarks/bench_llava.py $(ARGS)
