# Two commands matter: `make run` (install, then the main job on this host) and `make test`
# (install everything, Debian packages included, then the whole suite). Both are idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pyproject.toml declares compatible ranges (what a user's own environment may bring); the exact set
# that is tested -- every package, transitive ones included -- is pinned in constraints.txt, and every
# install here goes through it. constraints-lowest.txt pins the lowest versions the ranges allow; the
# tracking tests run on it in a second venv (inside .venv, so `make clean` and the tools' excludes cover it).
LOCK := constraints.txt
LOWEST := constraints-lowest.txt
LOWEST_VENV := $(VENV)/lowest
LOWEST_BIN := $(LOWEST_VENV)/bin
# The tests of collectors.tracking that start no root-only machinery (the live cgroup test is deselected),
# the reference backend's multi-worker launcher (uvicorn's supervisor differs across the range), and the triage
# receiver's HTTP layer (it subclasses uvicorn's httptools protocol).
LOWEST_TESTS := tests/test_dependencies.py tests/collectors/test_tracking_*.py tests/diag/test_rules_batching.py \
	tests/diag/test_rules_oom.py tests/diag/test_demo_serve.py tests/triage/test_webhook_http.py tests/triage/test_http_fuzz.py
PIP := python -m pip install --quiet --disable-pip-version-check
# Re-install whenever pyproject.toml or the pins change.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | sha1sum | cut -c1-12)
LOWEST_STAMP := $(LOWEST_VENV)/.installed-$(shell cat pyproject.toml $(LOWEST) | sha1sum | cut -c1-12)
# Debian packages the tests and benchmarks drive for real: wrk (bench/overhead.py), prometheus
# (the fleet-scale loader test, diag alerts), prometheus-alertmanager (amtool + the live alert and triage tests),
# chromium (report.html in a real browser), sosreport (bench/bundle.py), systemd (systemd-analyze verifies the shipped agent unit).
DEB_PACKAGES := wrk prometheus prometheus-alertmanager prometheus-node-exporter chromium sosreport systemd

.PHONY: install install-lowest system-deps run test test-lowest lint bench lock lock-lowest clean

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/$(PIP) --upgrade pip 2>&1 | { grep -v 'is ignored' || true; }; exit $${PIPESTATUS[0]}
	$(BIN)/$(PIP) -c $(LOCK) -e '.[dev]' 2>&1 | { grep -v 'is ignored' || true; }; exit $${PIPESTATUS[0]}
	@$(BIN)/python -c "import collectors, diag, prometheus_client, typer" || { echo "install failed"; exit 1; }
	@rm -f $(VENV)/.installed-*; touch $@

install: $(STAMP)

# The lowest set: the package with the lower bound of every range, and the test tools. pip check and
# tests/test_dependencies.py (run first in test-lowest) prove it is consistent and installed as pinned.
$(LOWEST_STAMP): pyproject.toml $(LOWEST)
	@test -x $(LOWEST_BIN)/python || $(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_BIN)/$(PIP) -c $(LOWEST) -e . pytest hypothesis 2>&1 | { grep -v 'is ignored' || true; }; exit $${PIPESTATUS[0]}
	$(LOWEST_BIN)/python -m pip check
	@rm -f $(LOWEST_VENV)/.installed-*; touch $@

install-lowest: $(LOWEST_STAMP)

system-deps:
	@missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "warning: missing Debian packages:$$missing (run as root, or: sudo apt-get install$$missing)"; fi; \
	fi

run: install
	$(BIN)/diag bundle

# The lowest set's tracking tests run first (a minute); a failure there fails `make test`, after the
# whole suite has still run.
TEST_LOWEST := LLMDIAG_CONSTRAINTS=$(LOWEST) $(LOWEST_BIN)/python -m pytest -q -m "not live" $(LOWEST_TESTS)
test: install install-lowest system-deps
	$(BIN)/ruff check .
	@echo "the tracking tests on the lowest versions the ranges allow ($(LOWEST)), then the whole suite"
	status=0; $(TEST_LOWEST) || status=$$?; $(BIN)/python -m pytest -q || status=$$?; exit $$status

test-lowest: install-lowest
	$(TEST_LOWEST)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install system-deps
	$(BIN)/python bench/snapshot.py

# Re-resolve the ranges of pyproject.toml to the newest releases and pin the result (every package) in
# constraints.txt; KEEP=1 keeps the current pins and only resolves what they do not cover. Then `make test`.
lock:
	$(PYTHON) .ci/lock.py tested $(if $(KEEP),--keep) --out $(LOCK)

# Resolve the lower bound of every range (plus the test tools as pinned in constraints.txt) and pin the result.
lock-lowest:
	$(PYTHON) .ci/lock.py lowest --out $(LOWEST)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
