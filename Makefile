# Three commands matter (`make help` lists them all): `make check`, the quick loop before each commit (lint
# and every test that starts no process and needs no root; a few minutes, any user); `make run` (install, then
# the main job on this host) and `make test` (install everything, Debian packages included, then the whole
# suite, spread over the cores). All are idempotent.
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
# The engines extra (llama-cpp-python's server, gguf) for `make test` only: `make check` never needs the engine.
ENGINES_STAMP := $(VENV)/.engines-$(shell cat pyproject.toml $(LOCK) | sha1sum | cut -c1-12)
# llama.cpp is compiled here from source. GGML_NATIVE=OFF: pip's wheel cache is keyed by the source archive, not
# by these flags, so a -march=native wheel (AVX-512 on this host) cached here and reused on an older CPU would die
# with SIGILL; without it the build targets AVX2/FMA/F16C, which every x86-64 CPU since 2015 has.
ENGINES_CMAKE_ARGS ?= -DGGML_NATIVE=OFF
# Debian packages the tests and benchmarks drive for real: wrk (bench/overhead.py), prometheus
# (the fleet-scale loader test, diag alerts), prometheus-alertmanager (amtool + the live alert and triage tests),
# chromium (report.html in a real browser), sosreport (bench/bundle.py), systemd (systemd-analyze verifies the shipped agent unit),
# postgresql-15 (the triage store on PostgreSQL: tests/pgserver.py runs its own cluster from /usr/lib/postgresql/15/bin).
DEB_PACKAGES := wrk prometheus prometheus-alertmanager prometheus-node-exporter victoria-metrics chromium sosreport systemd \
	postgresql-15

.PHONY: help install install-engines install-lowest install-guidellm install-all system-deps run check test test-lowest lint bench lock lock-lowest clean

# The tiers (marks registered in pyproject.toml): `live` needs root and real cgroups, `process` starts a
# process or a server (enforced by tests/tiers.py), `slow` takes over 10 s. `make check` leaves all three out.
CHECK_MARKS := not live and not process and not slow
# pytest-xdist workers for `make test`: the suite mostly waits on its servers and real runs (measured: ~950 s of
# CPU in ~2200 s of tests), so two workers per core of this 2-core CI host keep both cores busy. --dist loadgroup keeps each xdist_group on one worker (tests/conftest.py).
WORKERS ?= 4
# A read-only checkout (`make check` as another user): no caches written into the tree.
NO_TREE_CACHES = $$([ -w . ] || echo "-p no:cacheprovider")
RUFF_NO_CACHE = $$([ -w . ] || echo "--no-cache")

help:
	@echo "make check        lint (ruff check + format) + every test that starts no process and needs no root (the loop before each commit)"
	@echo "make test         install everything (Debian packages too), lint, the lowest-versions tests, the whole suite"
	@echo "make run          install, then diag bundle on this host"
	@echo "make lint         ruff check + ruff format --check"
	@echo "make test-lowest  the tracking tests on the lowest versions pyproject.toml allows"
	@echo "make install-guidellm  guidellm and the CPU build of torch in .venv/guidellm (the cross-check of diag gate)"
	@echo "make bench        the benchmarks (bench/RESULTS.md)"
	@echo "make lock         re-pin constraints.txt (KEEP=1: only what the pins do not cover)"
	@echo "make clean        remove the venvs and caches"

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/$(PIP) --upgrade pip 2>&1 | { grep -v 'is ignored' || true; }; exit $${PIPESTATUS[0]}
	$(BIN)/$(PIP) -c $(LOCK) -e '.[dev]' 2>&1 | { grep -v 'is ignored' || true; }; exit $${PIPESTATUS[0]}
	@$(BIN)/python -c "import collectors, diag, prometheus_client, typer" || { echo "install failed"; exit 1; }
	@rm -f $(VENV)/.installed-*; touch $@

install: $(STAMP)

$(ENGINES_STAMP): $(STAMP)
	CMAKE_ARGS="$(ENGINES_CMAKE_ARGS)" $(BIN)/$(PIP) -c $(LOCK) -e '.[dev,engines]' 2>&1 | { grep -v 'is ignored' || true; }; exit $${PIPESTATUS[0]}
	@$(BIN)/python -c "import llama_cpp.server, gguf" || { echo "engines install failed"; exit 1; }
	@rm -f $(VENV)/.engines-*; touch $@

install-engines: $(ENGINES_STAMP)

# The lowest set: the package with the lower bound of every range, and the test tools. pip check and
# tests/test_dependencies.py (run first in test-lowest) prove it is consistent and installed as pinned.
$(LOWEST_STAMP): pyproject.toml $(LOWEST)
	@test -x $(LOWEST_BIN)/python || $(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_BIN)/$(PIP) -c $(LOWEST) -e . pytest hypothesis 2>&1 | { grep -v 'is ignored' || true; }; exit $${PIPESTATUS[0]}
	$(LOWEST_BIN)/python -m pip check
	@rm -f $(LOWEST_VENV)/.installed-*; touch $@

install-lowest: $(LOWEST_STAMP)

# guidellm, for tests/gate/test_guidellm_crosscheck.py (a load tool no one here wrote checks `diag gate`'s generator),
# in a venv of its own: it needs torch (its data loader), which nothing else here does, and its own pins
# (constraints-guidellm.txt, every package; jinja2 too, which it imports without declaring). torch is pinned to the
# CPU build, 2.13.0+cpu: the package index's torch is the CUDA build with ~3 GB of NVIDIA wheels. pip finds the CPU
# wheel where its config lists one (find-links); elsewhere give it PyTorch's CPU index:
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make test. No CUDA build can slip in unnoticed: the pin
# has no match on the plain index, and the check below refuses a torch built for CUDA or any nvidia-* package.
# Measured: 1.5 GB, ~2.5 min from pip's cache. `make test` passes GUIDELLM to the suite, so there the cross-check
# runs or fails, never skips.
GUIDELLM_LOCK := constraints-guidellm.txt
GUIDELLM_VENV := $(VENV)/guidellm
GUIDELLM_BIN := $(GUIDELLM_VENV)/bin
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.installed-$(shell cat $(GUIDELLM_LOCK) | sha1sum | cut -c1-12)
$(GUIDELLM_STAMP): $(GUIDELLM_LOCK)
	@test -x $(GUIDELLM_BIN)/python || $(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_BIN)/$(PIP) -c $(GUIDELLM_LOCK) guidellm torch jinja2 2>&1 | { grep -v 'is ignored' || true; }; exit $${PIPESTATUS[0]}
	$(GUIDELLM_BIN)/python -m pip check
	@$(GUIDELLM_BIN)/python -c "import torch, importlib.metadata as m; \
	  gpu = sorted(d.name for d in m.distributions() if d.name.lower().startswith('nvidia')); \
	  assert torch.version.cuda is None and not gpu, f'not the CPU build of torch: cuda {torch.version.cuda}, {gpu}'"
	$(GUIDELLM_BIN)/guidellm --version
	@rm -f $(GUIDELLM_VENV)/.installed-*; touch $@

install-guidellm: $(GUIDELLM_STAMP)

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
# Every environment the suite needs, at once: they are separate venvs (the engines extend the main one, so they
# follow it), and pip is mostly CPU here -- unpacking, compiling -- so two cores build two at a time. Measured on a
# fresh clone with pip's cache warm: 2 min 25 s one after the other, 1 min 36 s so. Output is kept per target.
install-all:
	@$(MAKE) --no-print-directory -j4 --output-sync=target install install-engines install-lowest install-guidellm system-deps

test: install-all
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@echo "the whole suite ($(WORKERS) workers) and, beside it, the tracking tests on the lowest versions the ranges allow ($(LOWEST))"
	@# Beside, not before: the suite's wall time is its serial live group's, and the cores have room around it (75 s
	@# of the lowest versions' tests came off the whole run); their output follows the suite's.
	status=0; log=$$(mktemp); { $(TEST_LOWEST) > $$log 2>&1; echo $$? > $$log.rc; } & lowest=$$!; \
	GUIDELLM=$(abspath $(GUIDELLM_BIN))/guidellm $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup \
	  --durations=25 || status=$$?; wait $$lowest; echo "--- the tracking tests on the lowest versions ($(LOWEST)):"; \
	cat $$log; [ "$$(cat $$log.rc)" = 0 ] || status=1; rm -f $$log $$log.rc; exit $$status

# No root, no process, no server: safe and quick anywhere (one xdist worker per core; the workers are pytest itself,
# the tests start nothing) (the tree may be read-only, e.g. another user's clone).
check: install
	$(BIN)/ruff check $(RUFF_NO_CACHE) .
	$(BIN)/ruff format --check $(RUFF_NO_CACHE) .
	$(BIN)/python -m pytest -q -m "$(CHECK_MARKS)" -n auto --dist loadgroup $(NO_TREE_CACHES)

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
