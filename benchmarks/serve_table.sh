#!/usr/bin/env bash
# W1-nospec-shaped serving table on the device, kdaserve only, with kdaserve's own client
# (`kdaserve bench serve`: vLLM bench-serve metric definitions): random 8000-token prompts,
# 1000 output tokens, ignore_eos, completions endpoint; the limits of the issue-19 table.
# Run from the repo root with .whl (and .tcache) carried; results land in $OUT:
#   LEVELS=1,4,16,32,64 bash benchmarks/serve_table.sh
# Records the start-up time to /health and every "slow step" line the server logged after it.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -d /tmp/site/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if ls .tcache/triton.tar.xz.* >/dev/null 2>&1 && [ ! -d ~/.triton/cache ]; then
  mkdir -p ~/.triton && cat .tcache/triton.tar.xz.* | tar -xJf - -C ~/.triton
fi
MODEL=${MODEL:-/tmp/k48}
[ -f "$MODEL/config.json" ] || python3 -m kdaserve.entrypoints.cli make-model "$MODEL" \
  --preset kimi-linear-48b-a3b >/dev/null
LIMITS=${LIMITS:-"--max-num-seqs 64 --max-num-batched-tokens 8192 --max-model-len 12288 --gpu-memory-utilization 0.90 --no-enable-prefix-caching"}
PORT=8013
t0=$(date +%s.%N)
setsid python3 -m kdaserve.entrypoints.cli serve "$MODEL" --load-format dummy --served-model-name m \
  $LIMITS --port $PORT ${EXTRA:-} > "$OUT/serve${TAG:-}.log" 2>&1 &
pid=$!
until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; do
  sleep 1; kill -0 $pid 2>/dev/null || { tail -30 "$OUT/serve${TAG:-}.log"; exit 1; }
done
up=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")
echo "server healthy after $up s"
mark=$(wc -l < "$OUT/serve${TAG:-}.log")
python3 -m kdaserve.entrypoints.cli bench serve --base-url http://127.0.0.1:$PORT --model m --tokenizer "$MODEL" \
  --endpoint completions --input-len 8000 --output-len 1000 --ignore-eos \
  --concurrency ${LEVELS:-1,4,16,32,64} --warmup ${WARMUP:-1} --server-flags "$LIMITS ${EXTRA:-}" \
  --label "kdaserve${TAG:-}" --out "$OUT/serve_table${TAG:-}.json" 2>&1 | grep -v Warn | tail -30
echo "start-up to /health: $up s"; echo "$up" > "$OUT/startup_s${TAG:-}.txt"
echo "slow steps after /health:"; tail -n +$((mark + 1)) "$OUT/serve${TAG:-}.log" | grep -i "slow step" | head -20
kill -TERM -- -$pid 2>/dev/null; sleep 5; kill -KILL -- -$pid 2>/dev/null
grep -iE "KV cache|capacity" "$OUT/serve${TAG:-}.log" | head -3
