#!/usr/bin/env bash
# Set up a scratch venv with the PUBLISHED Mooncake wheel, so that our benchmarks and the
# API-shape test can run the real thing next to ours.
#
# Usage: scripts/setup_mooncake_peer.sh [VENV_DIR]
#   VENV_DIR defaults to $MOONCAKE_PEER_VENV, then to <repo>/.scratch/mooncake-venv
#   (.scratch/ is git-ignored). Python used to create it: $PYTHON (default python3).
#   Package spec: $MOONCAKE_PEER_PACKAGE (default mooncake-transfer-engine-non-cuda).
#
# Idempotent: an existing venv that already imports mooncake.engine is left alone.
# The last line printed on stdout is the venv's python path.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${MOONCAKE_PEER_VENV:-$ROOT/.scratch/mooncake-venv}}"
PKG="${MOONCAKE_PEER_PACKAGE:-mooncake-transfer-engine-non-cuda}"
PY="${PYTHON:-python3}"
export DEBIAN_FRONTEND=noninteractive

log() { echo "[mooncake-peer] $*" >&2; }

# The published wheel links against Debian's libibverbs even when no RDMA device exists.
have_ibverbs() {
  ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' \
    || dpkg -s libibverbs1 >/dev/null 2>&1
}
if ! have_ibverbs; then
  if [ "$(id -u)" = 0 ]; then
    log "installing libibverbs1 (needed by the published wheel)"
    if ! apt-get install -y -qq libibverbs1 >/dev/null 2>&1; then
      apt-get update -qq >/dev/null
      apt-get install -y -qq libibverbs1 >/dev/null
    fi
  else
    log "warning: libibverbs1 is missing and we are not root; importing mooncake may fail"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi

if ! "$VENV/bin/python" -c 'import mooncake.engine, mooncake.store' >/dev/null 2>&1; then
  log "installing $PKG into $VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  # numpy: our helper scripts (mooncake_core/bench/_mooncake_*.py) use it for buffers.
  "$VENV/bin/python" -m pip install -q "$PKG" numpy
fi

"$VENV/bin/python" -c 'import mooncake.engine, mooncake.store' \
  || { log "error: mooncake still fails to import in $VENV"; exit 1; }
log "ready: $("$VENV/bin/python" -m pip show "$PKG" 2>/dev/null | sed -n 's/^Version: /version /p')"
echo "$VENV/bin/python"
