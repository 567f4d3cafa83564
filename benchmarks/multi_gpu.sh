#!/usr/bin/env bash
# Tensor and decode context parallelism on several H200s (issue 25). Run from the repo root on
# nvidia-h200-x2 (seed8: nvidia-h200-x8); results land in $OUT (default /tmp/out). Carry .whl
# (wheels as for gpu_checks.sh) and, while the tree stays under the 64 MiB a call carries,
# .tcache; pass KDASERVE_COMMIT=<hash> (the device copy has no .git; every JSON records it).
# seed8 also carries .cache/guidellm-wheels: guidellm 0.8.1 and what the GPU image lacks, for
# Python 3.12, made here with `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any (...) -d
# .cache/guidellm-wheels guidellm==0.8.1 click==8.4.2 culsans aiologic datasets dill multiprocess
# fsspec ftfy wcwidth more-itertools h2 hpack hyperframe pydantic pydantic-core annotated-types
# typing-inspection pydantic-settings python-dotenv truststore websockets eval-type-backport
# faker loguru sanic sanic-routing html5tagger tracerite httptools ujson sniffio`.
#
# STAGES (comma list, default tests), run in this order, what each writes (TAG: h200x<GPUs>):
#   tests   pytest -m gpu tests/distributed: the tests that need two GPUs (NCCL)
#           -> gpu_tests_$TAG.json
#   equal   parallel_equality.py, layouts 1,2,2x2 (EQUAL_LAYOUTS), greedy with top-5 logprobs,
#           a process per layout, on /tmp/k48 (4 x 2000-token prompts, 64 out) then /tmp/k3mini
#           (EQUAL_MODELS), the time left shared between them
#           -> tp_equality_$TAG.json, tp_equality_k3mini_$TAG.json
#   engine  bench_engine.py on /tmp/k48 at TP=1, TP=2, TP=2 DCP=2 (ENGINE_LAYOUTS), 8000-token
#           prompts, --batches 1,16 --skip-throughput: KV capacity, decode step vs floor
#           -> engine_${TAG}_tp.json (a key per layout)
#   w2      w2_dcp.py: W2 (120000-token prompts sharing 114000, 400 out, concurrency 1 and 2,
#           prefix caching on) served at TP=2, then TP=2 DCP=2 -> w2_dcp_$TAG.json
#   w1      seed_table.py -tp 2: W1-nospec, then W1 with the DSpark drafter (K = 8; acceptance
#           synthetic, length 4.0: random weights cannot agree), concurrency 1,4,16
#           -> seed_${TAG}_tp2_W1-nospec.json, seed_${TAG}_tp2_W1.json
#   seed8   8 GPUs: the seed's `vllm serve` flags on `kdaserve serve` at TP=8 and its guidellm
#           settings (run_guidellm.sh: concurrent streams, 8000 / 1000 tokens, SEED8_SECONDS
#           = 150 s a level, at most 10 errors, seed 42, temperature 1.0, top_p 0.95). A TP=8
#           start-up and three 150 s levels do not fit one call: SEED8_STREAMS picks this call's
#           levels (default 1,4; then a call with SEED8_STREAMS=16)
#           -> seed_${TAG}_tp8_W1_guidellm_c<streams>.json
# Stages share one deadline, DEADLINE (570 s after the script starts): each one's budget is cut
# to the time left, and a stage or level that cannot fit is skipped (said in the log; the
# scripts record layouts and levels skipped for time). *_TIMEOUT is a backstop that sends
# SIGINT first, so the scripts stop their servers and still write their JSON. *_ARGS are
# appended to a stage's script, word-split (no spaces inside one argument:
# --server-args=--enforce-eager). Logs and raw outputs go to $OUT/raw, packed into
# $OUT/raw.tgz (the device returns at most 8 files). SAVE_TCACHE=1 writes the Triton cache
# back as $OUT/triton.tar.xz.* (fetch into .tcache/).
set -uo pipefail
OUT=${OUT:-/tmp/out}; RAW=$OUT/raw; mkdir -p "$RAW"
t0=$SECONDS
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on the lent multi-GPU hosts (KINDS.md); servers and ranks inherit it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .tcache/triton.tar.xz.* >/dev/null 2>&1; then
  mkdir -p ~/.triton && cat .tcache/triton.tar.xz.* | tar -xJf - -C ~/.triton && echo "triton cache restored"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
NGPU=$(nvidia-smi -L | grep -c '^GPU')
TAG=${TAG:-h200x$NGPU}
STAGES=${STAGES:-tests}
has() { [[ ,$STAGES, == *,$1,* ]]; }
note() { echo "[$((SECONDS - t0)) s] $*"; }
left() { echo $(( ${DEADLINE:-570} - (SECONDS - t0) )); }
cap() { local l; l=$(left); echo $(( $1 < l ? $1 : l )); }   # min(budget, time left)
# start a stage when it has 60 s or more and its GPUs
go() {
  has "$1" || return 1
  if (( NGPU < $2 )); then note "$1 skipped: it needs $2 GPUs, this machine has $NGPU"; return 1; fi
  if (( $(left) < 60 )); then note "$1 skipped: $(left) s left before DEADLINE"; return 1; fi
}
cli() { python3 -m kdaserve.entrypoints.cli "$@"; }
# the timeout sends SIGINT first: Python unwinds, its servers and layout processes are stopped
limit() { local s=$1; shift; timeout -s INT -k 20 "$s" "$@"; }
make_k48() { [[ -f /tmp/k48/config.json ]] || cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null; }
make_k3mini() { [[ -f /tmp/k3mini/config.json ]] || cli make-model /tmp/k3mini --preset kimi-k3-mini >/dev/null; }
make_dspark() {   # a random DSpark drafter for /tmp/k48 (K3 targets, with AttnRes, take none)
  make_k48
  [[ -f /tmp/k48-dspark/config.json ]] || cli make-model /tmp/k48-dspark --draft-for /tmp/k48 \
    --draft-method dspark >/dev/null
}
DSPARK_SPEC='{"method":"dspark","num_speculative_tokens":8,"draft_sample_method":"probabilistic","rejection_sample_method":"synthetic","synthetic_acceptance_length":4.0}'

if go tests 2; then
  limit $(cap ${TESTS_TIMEOUT:-300}) python3 -m pytest -v -p no:cacheprovider -m gpu \
    ${GPU_TESTS:-tests/distributed} > "$RAW/gpu_tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|SKIPPED|^E  |passed|failed" "$RAW/gpu_tests.log" | tail -40
  python3 benchmarks/multi_gpu_report.py tests "$RAW/gpu_tests.log" "$OUT/gpu_tests_$TAG.json"
  note "tests done"
fi

if go equal 2; then
  models=${EQUAL_MODELS:-k48,k3mini}; models=(${models//,/ })
  for i in "${!models[@]}"; do
    m=${models[$i]}
    if [[ $m == k48 ]]; then make_k48; model=/tmp/k48; name=tp_equality_$TAG
    else make_k3mini; model=/tmp/k3mini; name=tp_equality_k3mini_$TAG; fi
    budget=$(( ($(left) - 10) / (${#models[@]} - i) ))   # the time left, shared by the models
    (( budget < 60 )) && budget=$(( $(left) - 10 ))        # too little to share: this one first
    if (( budget < 60 )); then note "equal $m skipped: $budget s left"; continue; fi
    limit $((budget + 20)) python3 benchmarks/parallel_equality.py $model --load-format dummy \
      --layouts ${EQUAL_LAYOUTS:-1,2,2x2} --prompt-len ${EQUAL_PROMPT_LEN:-2000} \
      --num-prompts ${EQUAL_PROMPTS:-4} --max-tokens ${EQUAL_MAX_TOKENS:-64} \
      --time-budget $budget --out "$OUT/$name.json" ${EQUAL_ARGS:-} > "$RAW/$name.log" 2>&1
    grep -E "^layout|^verdict|Error|Traceback" "$RAW/$name.log" | tail -12
    note "equal $m done"
  done
fi

if go engine 2; then
  make_k48
  layouts=${ENGINE_LAYOUTS:-1x1,2x1,2x2}; layouts=(${layouts//,/ })
  runs=()
  for i in "${!layouts[@]}"; do
    lay=${layouts[$i]}; tp=${lay%x*}; dcp=${lay#*x}; key=tp${tp}_dcp${dcp}
    t=$(( ($(left) - 10) / (${#layouts[@]} - i) ))   # no run may eat the ones after it
    t=$(( t < ${ENGINE_TIMEOUT:-180} ? t : ${ENGINE_TIMEOUT:-180} ))
    if (( t < 60 )); then note "engine $key skipped: $t s"; continue; fi
    limit $t python3 benchmarks/bench_engine.py /tmp/k48 -tp $tp -dcp $dcp \
      --batches ${ENGINE_BATCHES:-1,16} --skip-throughput --out "$RAW/engine_$key.json" \
      ${ENGINE_ARGS:-} > "$RAW/engine_$key.log" 2>&1
    echo "== TP=$tp DCP=$dcp"
    grep -E '"kv_cache_tokens"|"engine_start_s"|^prefill|^batch|graphs vs|Error|Traceback' \
      "$RAW/engine_$key.log" | tail -8
    runs+=("$key=$RAW/engine_$key.json")
  done
  python3 benchmarks/multi_gpu_report.py merge "$OUT/engine_${TAG}_tp.json" "${runs[@]}"
  note "engine done"
fi

if go w2 2; then
  make_k48
  budget=$(cap ${W2_BUDGET:-540})
  limit $((budget + 20)) python3 benchmarks/w2_dcp.py /tmp/k48 --layouts ${W2_LAYOUTS:-2,2x2} \
    --time-budget $budget --out-dir "$RAW/w2" --out "$OUT/w2_dcp_$TAG.json" ${W2_ARGS:-} \
    > "$RAW/w2.log" 2>&1
  grep -v Warning "$RAW/w2.log" | tail -20
  note "w2 done"
fi

if go w1 2; then
  make_dspark
  budget=$(cap ${W1_BUDGET:-540})
  limit $((budget + 20)) python3 benchmarks/seed_table.py /tmp/k48 -tp ${W1_TP:-2} \
    --configs W1-nospec,W1 --spec-config "$DSPARK_SPEC" --draft-model /tmp/k48-dspark \
    --out-dir "$RAW/seed" --tag ${TAG}_tp2 --time-budget $budget ${W1_ARGS:-} \
    > "$RAW/w1.log" 2>&1
  grep -v Warning "$RAW/w1.log" | tail -25
  for c in W1-nospec W1; do
    mv "$RAW/seed/seed_table_${TAG}_tp2_$c.json" "$OUT/seed_${TAG}_tp2_$c.json"
  done
  note "w1 done"
fi

if go seed8 8; then
  # The seed's server flags but for the model paths, --load-format (dummy: the folders hold a
  # config only, no checkpoint for fastsafetensors to read) and the rejection sampler (synthetic,
  # as in w1: random weights make "standard" reject every draft). The model is the 48B Kimi
  # Linear preset: kimi-k3 (1.42 TiB) does not fit 8 x 141 GiB, and DSpark needs a
  # residual-stream target (K3's AttnRes is not one).
  make_dspark
  spec='{"model": "/tmp/k48-dspark", "method": "dspark", "num_speculative_tokens": 8, "draft_sample_method": "probabilistic", "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4.0}'
  port=${SEED8_PORT:-8000}
  server=(python3 -m kdaserve.entrypoints.cli serve /tmp/k48 --port $port
          --tensor-parallel-size 8 --load-format dummy --gpu-memory-utilization 0.9
          --reasoning-parser kimi_k3 --enable-auto-tool-choice --tool-call-parser kimi_k3
          --max-model-len auto --no-enable-prefix-caching --speculative-config "$spec")
  setsid "${server[@]}" > "$RAW/seed8_server.log" 2>&1 &
  spid=$!
  trap 'kill -TERM -- -$spid 2>/dev/null' EXIT
  up=0
  while (( $(left) > 0 )); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && { up=1; break; }
    kill -0 $spid 2>/dev/null || break
    sleep 1
  done
  note "seed8 server up=$up"
  grep -E "MLA KV cache|spec decode|Error" "$RAW/seed8_server.log" | tail -4
  streams=${SEED8_STREAMS:-1,4}
  secs=${SEED8_SECONDS:-150}
  dirs=()
  site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  for s in ${streams//,/ }; do   # guidellm's venv sees the image's site (torch, transformers)
    (( up )) || break
    if (( $(left) < secs + 40 )); then note "seed8 streams $s skipped: $(left) s left"; continue; fi
    env -u PYTHONPATH GUIDELLM_VENV=/tmp/guidellm-venv GUIDELLM_REUSE_SITE=$site \
      GUIDELLM_WHEELS=${GUIDELLM_WHEELS:-$PWD/.cache/guidellm-wheels} \
      timeout -k 10 $(( $(left) - 10 )) bash benchmarks/run_guidellm.sh \
      --target "http://127.0.0.1:$port" --streams $s --requests 0 --max-seconds $secs \
      --max-errors 10 --seed 42 --temperature 1.0 --top-p 0.95 --prompt-tokens 8000 \
      --output-tokens 1000 --tokenizer /tmp/k48 --out "$RAW/guidellm_c$s" \
      > "$RAW/guidellm_c$s.log" 2>&1
    tail -3 "$RAW/guidellm_c$s.log"
    curl -s "http://127.0.0.1:$port/metrics" | grep -E "^kdaserve:(spec_decode|kv_cache_capacity)" \
      > "$RAW/seed8_metrics_c$s.txt"
    dirs+=("$RAW/guidellm_c$s")
    note "seed8 streams $s done"
  done
  kill -TERM -- -$spid 2>/dev/null; wait $spid 2>/dev/null
  python3 benchmarks/multi_gpu_report.py guidellm "$OUT/seed_${TAG}_tp8_W1_guidellm_c${streams//,/-}.json" \
    "${dirs[@]:-$RAW/no-guidellm-run}" --server-log "$RAW/seed8_server.log" \
    --server-command "$(printf '%q ' "${server[@]}")"
fi

if [ -d ~/.triton/cache ] && [ "${SAVE_TCACHE:-0}" = 1 ]; then
  tar -cJf - -C ~/.triton cache | split -b 15M - "$OUT/triton.tar.xz."
fi
(cd "$OUT" && tar czf raw.tgz raw && rm -rf raw)
if (( $(ls "$OUT" | wc -l) > 8 )); then   # at most 8 files come back: results in one archive
  (cd "$OUT" && tar czf results.tgz --exclude='triton.tar.xz.*' --exclude=results.tgz . \
    && find . -maxdepth 1 -type f ! -name 'triton.tar.xz.*' ! -name results.tgz -delete)
fi
ls -la "$OUT"
note "all done"
