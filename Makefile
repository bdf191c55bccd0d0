# shardserver: `make demo` and `make test` work on a fresh machine (Python >= 3.11 as python3).
PYTHON ?= python3
VENV := .venv
SDK024 := .venv-sdk024
SDK015 := .venv-sdk015
SDK026 := .venv-sdk026
PIP_FLAGS := --quiet --disable-pip-version-check

.PHONY: demo test bench clean haproxy

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -e '.[test]'
	touch $@

# Environments with older SDKs for the compatibility tests: 0.24.1 (the last JSON-capable
# release; asks for proto first) and 0.15.0 (asks for JSON only, no /client/config).
$(SDK024)/.installed:
	$(PYTHON) -m venv $(SDK024)
	$(SDK024)/bin/pip install $(PIP_FLAGS) 'tinker==0.24.1'
	touch $@

$(SDK015)/.installed:
	$(PYTHON) -m venv $(SDK015)
	$(SDK015)/bin/pip install $(PIP_FLAGS) 'tinker==0.15.0'
	touch $@

# 0.26.2: the first release with the session-wide retrieve_futures poller and cancel_future.
$(SDK026)/.installed:
	$(PYTHON) -m venv $(SDK026)
	$(SDK026)/bin/pip install $(PIP_FLAGS) 'tinker==0.26.2'
	touch $@

# HAProxy >= 2.6 (Debian package) for the multi-host tests in tests/multihost/; installed when
# missing (needs root, as in CI), left alone when present.
haproxy:
	@command -v haproxy >/dev/null 2>&1 || test -x /usr/sbin/haproxy || { \
	  if [ "$$(id -u)" != 0 ]; then echo "haproxy is missing: apt-get install haproxy (as root)" >&2; exit 1; fi; \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y haproxy; }

demo: $(VENV)/.installed
	$(VENV)/bin/shardserver demo --config configs/demo.toml

test: $(VENV)/.installed $(SDK024)/.installed $(SDK015)/.installed $(SDK026)/.installed haproxy
	SHARDSERVER_OLD_SDKS_REQUIRED=1 $(VENV)/bin/python -m pytest

bench: $(VENV)/.installed
	$(VENV)/bin/pip install $(PIP_FLAGS) -e '.[test,bench]'
	$(VENV)/bin/python benchmarks/bench_codec.py
	$(VENV)/bin/python benchmarks/run_load.py --scenario burst-32k --quick

clean:
	rm -rf $(VENV) $(SDK024) $(SDK015) $(SDK026) .pytest_cache .hypothesis build *.egg-info
