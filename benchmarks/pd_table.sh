#!/usr/bin/env bash
# Prefill/decode disaggregation on one GPU (issue 24): W1-nospec-shaped serving (random
# 8000-token prompts, 1000 output tokens, ignore_eos, completions) at LEVELS through
# `kdaserve proxy` in front of a kv_producer and a kv_consumer instance of the same model, then
# against one instance alone; same client (`kdaserve bench serve`), same limits. After the PD
# run the consumer's /metrics give the pulls' bytes and latencies (bandwidth, mean pull time).
# Run from the repo root with .whl and .nixlkit carried. nixl-cu13's wheel (57 MB) does not fit
# the device's 64 MiB carry next to the tree, so .nixlkit holds it unpacked without nixl_ep
# (the expert-parallel library, unused here) as nixl_cu13.tar.xz (18 MB):
#   pip download --no-deps --python-version 3.12 --only-binary=:all: nixl-cu13 -d /tmp/nk
#   (mkdir x && cd x && unzip -q /tmp/nk/nixl_cu13-*.whl && rm -r nixl_ep_cu13 \
#    && tar -cJf ../.nixlkit/nixl_cu13.tar.xz .)
# Results land in $OUT:
#   LEVELS=4,16 [SINGLE=0] [KV_BUFFER=cpu] [UCX_TLS=...] bash benchmarks/pd_table.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -d /tmp/site/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl || exit 1
[ -d /tmp/site/nixl_cu13 ] || tar -xJf .nixlkit/nixl_cu13.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .tcache/triton.tar.xz.* >/dev/null 2>&1 && [ ! -d ~/.triton/cache ]; then
  mkdir -p ~/.triton && cat .tcache/triton.tar.xz.* | tar -xJf - -C ~/.triton
fi
MODEL=${MODEL:-/tmp/k3mini}
[ -f "$MODEL/config.json" ] || python3 -m kdaserve.entrypoints.cli make-model "$MODEL" \
  --preset ${PRESET:-kimi-k3-mini} >/dev/null
LIMITS=${LIMITS:-"--max-num-seqs 16 --max-num-batched-tokens 8192 --max-model-len 9216 --no-enable-prefix-caching"}
LEVELS=${LEVELS:-4,16}
pids=()

start() {  # name port memory-fraction extra-args...
  local name=$1 port=$2 mem=$3; shift 3
  setsid python3 -m kdaserve.entrypoints.cli serve "$MODEL" --load-format dummy \
    --served-model-name m $LIMITS --gpu-memory-utilization "$mem" --port "$port" "$@" \
    > "$OUT/pd_$name.log" 2>&1 &
  pids+=($!)
  local t0=$(date +%s)
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; do
    sleep 1
    kill -0 "${pids[-1]}" 2>/dev/null || { echo "$name died"; tail -30 "$OUT/pd_$name.log"; return 1; }
  done
  echo "$name healthy after $(( $(date +%s) - t0 )) s"
}

stop_all() {
  for p in "${pids[@]}"; do kill -TERM -- -"$p" 2>/dev/null; done
  sleep 5
  for p in "${pids[@]}"; do kill -KILL -- -"$p" 2>/dev/null; done
  pids=()
}

bench() {  # base-url label
  python3 -m kdaserve.entrypoints.cli bench serve --base-url "$1" --model m --tokenizer "$MODEL" \
    --endpoint completions --input-len 8000 --output-len 1000 --ignore-eos --concurrency "$LEVELS" \
    --warmup 1 --server-flags "$LIMITS" --label "$2" --out "$OUT/pd_table_$2.json" 2>&1 \
    | grep -v Warn | tail -12
}

if [ "${SINGLE:-1}" = 1 ]; then   # SINGLE=0: the PD run alone
  start single 8100 0.45 && bench http://127.0.0.1:8100 single
  stop_all
fi

BUF=${KV_BUFFER:-cuda}   # kv_buffer_device of both instances (cpu: through pinned host buffers)
KVP='{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"'$BUF'","kv_connector_extra_config":{"hold_timeout_s":300}}'
KVC='{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"'$BUF'","kv_connector_extra_config":{"load_timeout_s":120}}'
if start prefill 8101 0.45 --kv-transfer-config "$KVP" && start decode 8102 0.45 --kv-transfer-config "$KVC"; then
  setsid python3 -m kdaserve.entrypoints.cli proxy --prefill http://127.0.0.1:8101 \
    --decode http://127.0.0.1:8102 --port 8103 > "$OUT/pd_proxy.log" 2>&1 &
  pids+=($!)
  sleep 3
  bench http://127.0.0.1:8103 pd
  python3 - <<'EOF' | tee "$OUT/pd_transfers.json"
import json, urllib.request
text = urllib.request.urlopen("http://127.0.0.1:8102/metrics", timeout=10).read().decode()
m = {}
for line in text.splitlines():
    if line.startswith("kdaserve:kv_transfer") and not line.startswith("#"):
        name, value = line.split()[0].split("{")[0], float(line.split()[-1])
        m[name] = value
loads = m.get("kdaserve:kv_transfer_loads_total", 0.0)
secs = m.get("kdaserve:kv_transfer_seconds_total", 0.0)
nbytes = m.get("kdaserve:kv_transfer_bytes_total", 0.0)
print(json.dumps({"metrics": m, "mean_pull_ms": 1e3 * secs / loads if loads else None,
                  "pull_gib_s": nbytes / secs / 2**30 if secs else None}, indent=1))
EOF
fi
stop_all
grep -iE "error|refused|failed" "$OUT"/pd_*.log | grep -v "GET /metrics" | head -20
