#!/usr/bin/env bash
# Set up a scratch venv with the PUBLISHED Mooncake wheel, so that our benchmarks and the
# API-shape test can run the real thing next to ours.
#
# Usage: scripts/setup_mooncake_peer.sh [--torch] [--sglang] [VENV_DIR]
#   --torch (or MOONCAKE_PEER_TORCH=1) also installs the CPU torch from this machine's disk,
#   safetensors and pillow, for the published tensor methods and structured object store
#   (tests/integration/test_compat_tensors.py / test_compat_structured.py compare them with
#   ours; without torch or Pillow those comparisons skip, saying so). Opt-in: it
#   takes about 2 minutes and 1 GB in a fresh venv, too much for every CI run.
#   --sglang (or MOONCAKE_PEER_SGLANG=1) also installs SGLang's classes into that venv, for
#   `mooncake-core bench sglang --compare-mooncake PY` (SGLang's built-in MooncakeStore
#   backend on the published wheel): sglang --no-deps at the version scripts/setup.sh gives
#   .venv, the CPU torch from this machine's disk, triton and the packages SGLang's storage
#   modules import (about 1.5 GB, 1-3 minutes). Opt-in: `make test` does not need it.
#   VENV_DIR defaults to $MOONCAKE_PEER_VENV, then to <repo>/.scratch/mooncake-venv
#   (.scratch/ is git-ignored). Python used to create it: $PYTHON (default python3).
#   Package spec: $MOONCAKE_PEER_PACKAGE (default mooncake-transfer-engine-non-cuda).
#
# Idempotent: an existing venv that already imports mooncake.engine is left alone.
# The last line printed on stdout is the venv's python path.
set -euo pipefail
WITH_SGLANG="${MOONCAKE_PEER_SGLANG:-0}"
WITH_TORCH="${MOONCAKE_PEER_TORCH:-0}"
while [ "${1:-}" = "--sglang" ] || [ "${1:-}" = "--torch" ]; do
  if [ "$1" = "--sglang" ]; then WITH_SGLANG=1; else WITH_TORCH=1; fi
  shift
done
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
  # numpy: our helper scripts (benchmarks/published/_mooncake_*.py) use it for buffers.
  "$VENV/bin/python" -m pip install -q "$PKG" numpy
fi

"$VENV/bin/python" -c 'import mooncake.engine, mooncake.store' \
  || { log "error: mooncake still fails to import in $VENV"; exit 1; }

# --- optional: torch for the published tensor methods (--torch) -----------------------
if [ "$WITH_TORCH" = 1 ] && ! "$VENV/bin/python" -c 'import torch, safetensors, PIL' >/dev/null 2>&1; then
  log "installing torch==2.13.0 (CPU), safetensors and pillow into $VENV (--torch; about 2 minutes)"
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" safetensors pillow \
    || { log "error: cannot install torch==2.13.0 (CPU), safetensors and pillow into $VENV"; exit 1; }
fi

# --- optional: SGLang's classes next to the published wheel (--sglang) ---------------
# Same pins as scripts/setup.sh installs into .venv, so both sides run the same SGLang code.
SGLANG_PINS="torch==2.13.0 sglang==0.5.23 triton==3.8.0 gguf==0.19.0"
SGLANG_DEPS="orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp \
transformers dill apache-tvm-ffi sentencepiece compressed-tensors"
SGLANG_STAMP="$VENV/.mooncake-peer-sglang-stamp"
# The bench's own helper imports SGLang's pool and MooncakeStore modules the way it runs them.
SGLANG_CHECK="$ROOT/benchmarks/published/_mooncake_sglang.py"
if [ "$WITH_SGLANG" = 1 ]; then
  want="$(echo "$SGLANG_PINS $SGLANG_DEPS" | sha256sum | cut -d' ' -f1)"
  if [ ! -f "$SGLANG_STAMP" ] || [ "$(cat "$SGLANG_STAMP")" != "$want" ]; then
    log "installing SGLang's classes into $VENV (--sglang; 1-3 minutes)"
    rm -f "$SGLANG_STAMP"
    # torch first: pip takes the CPU wheel from this machine's disk (sglang pins a CUDA one,
    # hence --no-deps for sglang itself).
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" \
      || { log "error: cannot install torch==2.13.0 (CPU) into $VENV"; exit 1; }
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pip install -q --no-deps $SGLANG_PINS \
      || { log "error: cannot install $SGLANG_PINS into $VENV"; exit 1; }
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pip install -q $SGLANG_DEPS \
      || { log "error: cannot install SGLang's storage-module dependencies into $VENV"; exit 1; }
    # torchvision stays out: PyPI's builds are CUDA ones (the bench helper stands in for it).
    if ! out="$("$VENV/bin/python" "$SGLANG_CHECK" check 2>&1)"; then
      log "error: SGLang's MooncakeStore module still fails to import in $VENV: $(echo "$out" | tail -n 1)"
      exit 1
    fi
    echo "$want" > "$SGLANG_STAMP"
  fi
  log "sglang: $("$VENV/bin/python" -m pip show sglang 2>/dev/null | sed -n 's/^Version: /version /p')"
fi
# --------------------------------------------------------------------------------------
log "ready: $("$VENV/bin/python" -m pip show "$PKG" 2>/dev/null | sed -n 's/^Version: /version /p')"
echo "$VENV/bin/python"
