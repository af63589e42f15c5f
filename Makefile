# Two commands matter: `make run` (install, then the main job on this host) and `make test`
# (install everything, Debian packages included, then the whole suite). Both are idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Re-install whenever pyproject.toml changes.
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
# Debian packages the tests and benchmarks drive for real: wrk (bench/overhead.py), prometheus
# (the fleet-scale loader test, diag alerts), prometheus-alertmanager (amtool + the live alert and triage tests),
# chromium (report.html in a real browser), sosreport (bench/bundle.py), systemd (systemd-analyze verifies the shipped agent unit).
DEB_PACKAGES := wrk prometheus prometheus-alertmanager prometheus-node-exporter chromium sosreport systemd

.PHONY: install system-deps run test lint bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip 2>&1 | grep -v 'is ignored' || true
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v 'is ignored' || true
	@$(BIN)/python -c "import collectors, diag, prometheus_client, typer" || { echo "install failed"; exit 1; }
	@rm -f $(VENV)/.installed-*; touch $@

install: $(STAMP)

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

test: install system-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install system-deps
	$(BIN)/python bench/snapshot.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
