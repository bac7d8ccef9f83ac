#!/usr/bin/env bash
# One-time (idempotent) set-up of this checkout on a fresh Debian machine:
# system packages, .venv at the repo root, every package of the suite in editable mode.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export DEBIAN_FRONTEND=noninteractive
STAMP=.venv/.mooncake-setup-stamp

need_apt=()
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server etcd-client)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "[setup] installing system packages: ${need_apt[*]}"
    apt-get update -qq >/dev/null && apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "[setup] warning: not root; cannot install ${need_apt[*]} (etcd tests will be skipped)" >&2
  fi
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
# Re-install only when a pyproject changed since the last successful set-up.
hash_now="$(cat pyproject.toml plugins/*/pyproject.toml conformance/pyproject.toml scripts/setup.sh 2>/dev/null | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$hash_now" ]; then
  exit 0
fi
echo "[setup] installing packages into .venv (editable)"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# torch: the CPU wheel that lies on this machine's disk (pip takes it from there).
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]" -e ./conformance \
  -e ./plugins/vllm -e ./plugins/sglang -e ./plugins/lmdeploy -e ./plugins/trtllm
echo "$hash_now" > "$STAMP"
echo "[setup] done"
