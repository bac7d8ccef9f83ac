# Quick start:  make demo   (main job)     make test   (whole test suite)
.PHONY: setup demo demo-transfer test test-quick lint types bench mooncake-peer
PY := .venv/bin/python

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m mooncake_core pd-demo

demo-transfer: setup
	$(PY) -m mooncake_core demo

# TEST_WORKERS=2: two pytest-xdist workers, one test module (or all engine modules) per
# worker at a time (see conftest.py). Default 0, one process: on 2 cores the engine tests
# are CPU-bound, and two workers were not faster, only closer to the per-test timeouts.
TEST_WORKERS ?= 0
# lint and the peer venv side by side: mypy keeps one core busy, pip the other.
test: setup
	@$(MAKE) --no-print-directory -j2 lint mooncake-peer
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --durations=25

# The published Mooncake wheel in a scratch venv: the comparison tests run our compat
# layer and the real package side by side (they skip, saying why, if this failed).
mooncake-peer:
	@bash scripts/setup_mooncake_peer.sh >/dev/null 2>&1 || echo "[setup] published Mooncake wheel unavailable; comparison tests will skip"

test-quick: setup
	$(PY) -m pytest -q -m "not slow" -p no:cacheprovider

# lint-imports checks the import layering in .importlinter (no cycles, no adapter in the core).
lint: setup
	$(PY) -m ruff check --no-cache conftest.py mooncake_core plugins conformance tests benchmarks examples
	$(PY) -m ruff format --no-cache --check conftest.py mooncake_core plugins conformance tests benchmarks examples
	$(PY) -m mypy
	.venv/bin/lint-imports --no-cache --no-logo

bench: setup
	$(PY) -m mooncake_core bench transfer
