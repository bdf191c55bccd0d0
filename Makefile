# shardserver: `make demo` and `make test` work on a fresh machine (Python >= 3.11 as python3).
PYTHON ?= python3
VENV := .venv
SDK024 := .venv-sdk024
PIP_FLAGS := --quiet --disable-pip-version-check

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -e '.[test]'
	touch $@

# A second environment with a JSON-era SDK (tinker 0.24.1) for the compatibility tests.
$(SDK024)/.installed:
	$(PYTHON) -m venv $(SDK024)
	$(SDK024)/bin/pip install $(PIP_FLAGS) 'tinker==0.24.1'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/shardserver demo --config configs/demo.toml

test: $(VENV)/.installed $(SDK024)/.installed
	SHARDSERVER_SDK024_PYTHON=$(CURDIR)/$(SDK024)/bin/python $(VENV)/bin/python -m pytest

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/bench_codec.py

clean:
	rm -rf $(VENV) $(SDK024) .pytest_cache .hypothesis build *.egg-info
