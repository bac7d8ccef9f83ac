# Quick start:  make demo   (main job)     make test   (whole test suite)
.PHONY: setup demo test test-quick lint types bench
PY := .venv/bin/python

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m mooncake_core demo

test: setup lint
	$(PY) -m pytest -q -p no:cacheprovider

test-quick: setup
	$(PY) -m pytest -q -m "not slow" -p no:cacheprovider

lint: setup
	$(PY) -m ruff check mooncake_core plugins conformance tests benchmarks examples
	$(PY) -m mypy

bench: setup
	$(PY) -m mooncake_core bench transfer
