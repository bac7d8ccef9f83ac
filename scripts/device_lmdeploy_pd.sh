#!/usr/bin/env bash
# A real LMDeploy prefill + decode pair on one GPU, KV migrated by mooncake-lmdeploy's
# backend (`--migration-backend Mooncake`), next to a hybrid (monolithic) engine as the
# reference. Prepared for a machine with an NVIDIA GPU; NOT run in this repository's CI
# (LMDeploy's engine has no CPU device).
#
# Needs, on that machine: a Python (PYTHON, default python3) with LMDeploy 0.18.0 and its
# CUDA torch, plus this checkout's packages:
#     pip install lmdeploy==0.18.0 && pip install -e . -e ./conformance -e ./plugins/lmdeploy
# and a small chat model on disk (MODEL, default ./models/Qwen2.5-0.5B-Instruct; any
# model LMDeploy's pytorch backend serves). Nothing is downloaded.
#
# What it checks: the 'Mooncake' migration backend in LMDeploy's registry is ours (the
# .pth hook, no flag beyond LMDeploy's own); prompts sent through `lmdeploy serve proxy
# --serving-strategy DistServe` come back with the same greedy completions as the hybrid
# engine; the decode engine's log shows our backend linking to the prefill engine.
# Results: $OUT/lmdeploy_pd.json (OUT defaults to ./.scratch/device-lmdeploy), logs beside.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
MODEL="${MODEL:-$ROOT/models/Qwen2.5-0.5B-Instruct}"
OUT="${OUT:-$ROOT/.scratch/device-lmdeploy}"
mkdir -p "$OUT"
PROXY_PORT=${PROXY_PORT:-8000}
P_PORT=${P_PORT:-23333}
D_PORT=${D_PORT:-23334}
H_PORT=${H_PORT:-23335}
HOST=127.0.0.1
# our engine: TCP between the two engine processes (device memory is staged through host
# memory; shared memory cannot reach GPU pools); a migration fails after 60 s, never hangs
export MOONCAKE_TRANSFER_SHM=0 MOONCAKE_LMDEPLOY_MIGRATION_TIMEOUT_S=60 PYTHONUNBUFFERED=1
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
fail() { echo "device_lmdeploy_pd: $*" >&2; echo "{\"ok\": false, \"error\": \"$*\"}" >"$OUT/lmdeploy_pd.json"; exit 1; }

command -v nvidia-smi >/dev/null && nvidia-smi -L || fail "no NVIDIA GPU (nvidia-smi)"
[ -d "$MODEL" ] || fail "MODEL=$MODEL is not a directory"
"$PY" - <<'EOF' || fail "LMDeploy's Mooncake migration backend is not mooncake-lmdeploy's"
import torch, lmdeploy
from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS
cls = MIGRATION_BACKENDS.module_dict["Mooncake"]
print("lmdeploy", lmdeploy.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available())
print("Mooncake backend:", cls.__module__, cls.__name__)
assert torch.cuda.is_available() and cls.__module__ == "mooncake_lmdeploy.migration"
EOF

COMMON=(--backend pytorch --server-name "$HOST" --cache-max-entry-count 0.15 --log-level INFO)
"$PY" -m lmdeploy serve proxy --server-name "$HOST" --server-port "$PROXY_PORT" \
  --serving-strategy DistServe --routing-strategy min_expected_latency \
  >"$OUT/proxy.log" 2>&1 & pids+=($!)
sleep 3
"$PY" -m lmdeploy serve api_server "$MODEL" "${COMMON[@]}" --server-port "$P_PORT" \
  --role Prefill --migration-backend Mooncake --proxy-url "http://$HOST:$PROXY_PORT" \
  >"$OUT/prefill.log" 2>&1 & pids+=($!)
"$PY" -m lmdeploy serve api_server "$MODEL" "${COMMON[@]}" --server-port "$D_PORT" \
  --role Decode --migration-backend Mooncake --proxy-url "http://$HOST:$PROXY_PORT" \
  >"$OUT/decode.log" 2>&1 & pids+=($!)
"$PY" -m lmdeploy serve api_server "$MODEL" "${COMMON[@]}" --server-port "$H_PORT" \
  >"$OUT/hybrid.log" 2>&1 & pids+=($!)

"$PY" - "$HOST" "$PROXY_PORT" "$P_PORT" "$D_PORT" "$H_PORT" "$OUT" <<'EOF'
import json, sys, time, urllib.request
host, proxy, p, d, h, out = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]

def get(port, path):
    with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10) as r:
        return json.loads(r.read())

def post(port, path, body):
    req = urllib.request.Request(f"http://{host}:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())

deadline = time.time() + 600
for port in (p, d, h, proxy):
    while True:
        try:
            model = get(port, "/v1/models")["data"][0]["id"]
            break
        except Exception:
            if time.time() > deadline:
                sys.exit(f"port {port} never answered /v1/models")
            time.sleep(3)
prompts = [
    "Explain in two sentences what a KV cache is.",
    "List three prime numbers greater than 100.",
    "Write a haiku about disaggregated inference.",
    "What is the capital of France? Answer in one word, then explain why in detail. " * 8,
]
rows, same = [], 0
for q in prompts:
    body = {"model": model, "messages": [{"role": "user", "content": q}],
            "max_tokens": 48, "temperature": 0, "top_k": 1}
    t0 = time.time(); pd = post(proxy, "/v1/chat/completions", body); t_pd = time.time() - t0
    ref = post(h, "/v1/chat/completions", body)
    a, b = pd["choices"][0]["message"]["content"], ref["choices"][0]["message"]["content"]
    same += a == b
    rows.append({"prompt": q[:60], "pd": a, "hybrid": b, "equal": a == b, "pd_s": round(t_pd, 2)})
    print(f"{'SAME' if a == b else 'DIFF'} {t_pd:.2f}s  {q[:50]!r}\n  pd:     {a[:120]!r}\n  hybrid: {b[:120]!r}")
res = {"ok": same == len(prompts), "equal": same, "prompts": len(prompts), "rows": rows}
json.dump(res, open(f"{out}/lmdeploy_pd.json", "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k != "rows"}))
sys.exit(0 if res["ok"] else 1)
EOF
rc=$?
if grep -q "mooncake-lmdeploy: linked" "$OUT/decode.log"; then
  echo "decode log: our backend linked to the prefill engine"
else
  echo "decode log: no 'mooncake-lmdeploy: linked' line (did the migration use our backend?)" >&2
  rc=1
fi
grep -h -i "migrat" "$OUT/decode.log" | tail -5
exit $rc
