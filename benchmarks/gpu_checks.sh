#!/usr/bin/env bash
# One device call: GPU tests + layer and engine benchmarks on the H200. Run from the repo root
# with .whl carried; results land in $OUT. Wheels for the offline GPU image:
#   bash ../shared/tools/gpu-wheels.sh .whl opentelemetry-api annotated-doc
# (fastapi >= 0.165 imports opentelemetry; without it the server cannot start there).
#
# Stages (STAGES, comma list): tests, engine, prefix, roofline (W4 with the full default grid
# unless ROOFLINE_ARGS narrows it), profile, seed, dspark (W1-nospec then W1 with a DSpark
# drafter, K = 8, synthetic acceptance length 4.0, DSPARK_ARGS e.g. "--time-budget 500"), kbench (bench_gemv, bench_sampler),
# offload (bench_offload.py on W2's shape, OFFLOAD_ARGS),
# breakdown (step_breakdown.py plain unless BREAKDOWN_PLAIN=0, + speculative), verify (the DSpark
# verify step's parts: step_breakdown.py at 8000-token prompts with PDL off, so kernel times do
# not overlap, and bench_batch.py's MoE / MLA at verify shapes, VERIFY_ARGS), fold (the DSpark step at
# 8000-token prompts with mla_verify_fold off, then on, same lease; FOLD_MODEL), abnew (step_breakdown.py
# plain at ABNEW_BATCHES and DSpark at 1,16, 8000-token prompts, with the defaults and with
# ABNEW_OFF: router_partials and sampling_race_kernel off by default), ablation (W1 switches,
# ABLATION_ARGS e.g. "--runs all-on,no-kda-state-mode --time-budget 500"),
# firststeps (first_steps.py: compiles and autotuning per engine step), coldstart (engine
# start on an empty Triton cache: fla autotuning, then the configs it chose, then those and
# COLD_WORKERS compile processes; COLD_MODEL, COLD_ARGS e.g. a --speculative-config),
# mixed (bench_mixed.py:
# a prompt among decodes against its parts, bursts twice, MIXED_ARGS), chain (bench_chain.py,
# CHAIN_ARGS), gaps (prefill_gaps.py once per JSON in GAPS_CONFIGS, GAPS_MODEL), batch (bench_batch.py,
# BATCH_ARGS), router (bench_prefill.py's router case at ROUTER_TOKENS rows, graph-timed below
# 4096), pkernels (bench_prefill.py's PKERNELS_CASES at PKERNELS_TOKENS: the conv and MLA prefill attention kernels by
# default), sampling (bench_sampler.py's three samplers at SAMPLER_BATCHES rows), topp
# (bench_top_p.py at TOPP_BATCHES rows and TOPP_TILES search tiles), layers; each has a
# *_TIMEOUT. PACK=1 tars $OUT (less the Triton cache) into results.tgz.
# ENGINE_ARGS='--optimization-config {"pdl":false}' (or "decode_gemv", "fused_kda_decode"; no
# spaces in the JSON: the variable is word-split) times the engine without a default kernel choice.
#
# Triton/fla compile time dominates a cold call (~100 s). Carry `.tcache` (git-ignored) to reuse
# the previous call's Triton cache: the script restores .tcache/triton.tar.xz.* if present and
# writes the cache back as $OUT/triton.tar.xz.* (16 MiB parts; fetch them into .tcache/) unless
# SAVE_TCACHE=0. The device returns at most 8 files: tar the rest of $OUT into one.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
if ls .tcache/triton.tar.xz.* >/dev/null 2>&1; then
  mkdir -p ~/.triton && cat .tcache/triton.tar.xz.* | tar -xJf - -C ~/.triton && echo "triton cache restored"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
STAGES=${STAGES:-tests,engine,layers}
make_k12() {   # the 48B config cut to 12 layers (9 KDA, 3 MLA): the same kernel shapes, fits an H100
  [ -f /tmp/k12/config.json ] && return
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k12 --preset kimi-linear-48b-a3b >/dev/null
  python3 - <<'PY'
import json
p = "/tmp/k12/config.json"
c = json.load(open(p))
c["num_hidden_layers"] = 12
c["linear_attn_config"].update(kda_layers=[1, 2, 3, 5, 6, 7, 9, 10, 11], full_attn_layers=[4, 8, 12])
json.dump(c, open(p, "w"), indent=1)
PY
}
run_tests() {
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -v -p no:cacheprovider -m gpu ${GPU_TESTS:-tests} 2>&1 \
    | grep -E "PASSED|FAILED|ERROR|^E  |passed|failed" | tail -60 | tee "$OUT/gpu_tests.log"
}
[[ $STAGES == tests* ]] && run_tests
if [[ $STAGES == *engine* ]]; then
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  timeout ${ENGINE_TIMEOUT:-400} python3 benchmarks/bench_engine.py /tmp/k48 --out "$OUT/engine.json" ${ENGINE_ARGS:-} 2>&1 \
    | grep -v Warning | tail -30 | tee "$OUT/engine.log"
fi
if [[ $STAGES == *prefix* ]]; then
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  timeout ${PREFIX_TIMEOUT:-300} python3 benchmarks/bench_prefix.py /tmp/k48 --out "$OUT/prefix.json" \
    ${PREFIX_ARGS:-} 2>&1 | grep -v Warning | tail -30 | tee "$OUT/prefix.log"
fi
if [[ $STAGES == *roofline* ]]; then
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  timeout ${ROOFLINE_TIMEOUT:-300} python3 -m kdaserve.entrypoints.cli bench roofline /tmp/k48 \
    --out "$OUT/roofline.json" ${ROOFLINE_ARGS:-} 2>&1 | grep -v Warning | tail -20
fi
if [[ $STAGES == *profile* ]]; then
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/profile_step.py /tmp/k48 --out "$OUT/profile.json" \
    ${PROFILE_ARGS:-} 2>&1 | grep -v Warning | tail -60 | tee "$OUT/profile.log"
fi
if [[ $STAGES == *seed* ]]; then   # W1-nospec and W1 tables (issue 5), needs opentelemetry-api in .whl
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  timeout ${SEED_TIMEOUT:-600} python3 benchmarks/seed_table.py /tmp/k48 --draft-model /tmp/k48-draft \
    --out-dir "$OUT/seed" ${SEED_ARGS:-} 2>&1 | grep -v Warning | tail -25 | tee "$OUT/seed.log"
fi
if [[ $STAGES == *dspark* ]]; then   # W1-nospec and W1 with the DSpark drafter (issue 20), same lease
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  timeout ${DSPARK_TIMEOUT:-590} python3 benchmarks/seed_table.py /tmp/k48 --configs ${DSPARK_CONFIGS:-W1-nospec,W1} \
    --spec-config '{"method":"dspark","num_speculative_tokens":8,"draft_sample_method":"probabilistic","rejection_sample_method":"synthetic","synthetic_acceptance_length":4.0}' \
    --draft-model /tmp/k48-dspark --out-dir "$OUT/seed" --tag dspark ${DSPARK_ARGS:-} 2>&1 \
    | grep -v Warning | tail -25 | tee "$OUT/dspark.log"
fi
if [[ $STAGES == *kbench* ]]; then   # the GEMV candidate vs cuBLAS, the sampler kernels
  timeout ${KBENCH_TIMEOUT:-240} python3 benchmarks/bench_gemv.py --out "$OUT/gemv.json" ${GEMV_ARGS:-} 2>&1 | tail -30 | tee "$OUT/gemv.log"
  timeout 150 python3 benchmarks/bench_sampler.py --batches ${SAMPLER_BATCHES:-1,16,64,144} --out "$OUT/sampler.json" 2>&1 | tail -40 | tee "$OUT/sampler.log"
fi
if [[ $STAGES == *breakdown* ]]; then   # per-step wall time + cProfile (plain, then speculative)
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  [ "${BREAKDOWN_PLAIN:-1}" = 1 ] && timeout ${BREAKDOWN_TIMEOUT:-200} python3 benchmarks/step_breakdown.py \
    /tmp/k48 --batches 1,16 --out "$OUT/breakdown_nospec.json" 2>&1 | grep -v Warn | tail -40 \
    | tee "$OUT/breakdown.log"
  timeout ${BREAKDOWN_TIMEOUT:-200} python3 benchmarks/step_breakdown.py /tmp/k48 \
    --draft-model /tmp/k48-draft --spec-batches 1,4 --steps 20 --out "$OUT/breakdown_spec.json" \
    2>&1 | grep -v Warn | tail -40 | tee -a "$OUT/breakdown.log"
fi
if [[ $STAGES == *verify* ]]; then   # issue 20: where a verify step's time goes at 8K context
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  timeout ${VERIFY_TIMEOUT:-200} python3 benchmarks/step_breakdown.py /tmp/k48 \
    --draft-model /tmp/k48-dspark --draft-method dspark --spec-batches 1,16 --prompt-len 8000 \
    --steps 10 --optimization-config '{"pdl":false}' --out "$OUT/breakdown_verify.json" 2>&1 \
    | grep -v Warn | grep -E "ms/step synced|device:|a replay|ms/step +[0-9.]+x" | tee "$OUT/verify.log"
  timeout ${VERIFY_BATCH_TIMEOUT:-380} python3 benchmarks/bench_batch.py --cases moe,mla \
    --batches ${VERIFY_BATCHES:-9,72,144,288} --mla-rows-per-seq 9 --time-budget 300 --out "$OUT/batch_verify.json" \
    ${VERIFY_ARGS:-} 2>&1 | grep -v Warn | tail -20 | tee -a "$OUT/verify.log"
fi
if [[ $STAGES == *fold* ]]; then   # A/B of KernelConfig.mla_verify_fold on the DSpark step
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  [[ ${FOLD_MODEL:-} == /tmp/k12 ]] && make_k12   # FOLD_MODEL=/tmp/k12 on an H100
  for fold in false true; do
    timeout ${FOLD_TIMEOUT:-200} python3 benchmarks/step_breakdown.py ${FOLD_MODEL:-/tmp/k48} \
      --draft-model ${FOLD_MODEL:-/tmp/k48}-dspark --draft-method dspark --spec-batches ${FOLD_BATCHES:-1,4,16} \
      --prompt-len 8000 --steps 20 --optimization-config "{\"mla_verify_fold\":$fold}" \
      --out "$OUT/breakdown_fold_$fold.json" 2>&1 | grep -v Warn \
      | grep -E "ms/step synced|device:|a replay" | tee -a "$OUT/fold.log"
  done
fi
if [[ $STAGES == *abnew* ]]; then   # the new CUDA-path defaults against their own off switches
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  for name in on off; do
    cfg='{}'; [ $name = off ] && cfg=${ABNEW_OFF:-'{"router_partials":false,"sampling_race_kernel":false}'}
    timeout ${ABNEW_TIMEOUT:-200} python3 benchmarks/step_breakdown.py /tmp/k48 --batches ${ABNEW_BATCHES:-1,4,16,32} \
      --prompt-len 8000 --steps 20 --optimization-config "$cfg" --out "$OUT/breakdown_new_$name.json" 2>&1 \
      | grep -v Warn | grep -E "ms/step synced|device:|a replay" | tee -a "$OUT/abnew.log"
    timeout ${ABNEW_TIMEOUT:-200} python3 benchmarks/step_breakdown.py /tmp/k48 --draft-model /tmp/k48-dspark \
      --draft-method dspark --spec-batches 1,16 --prompt-len 8000 --steps 20 --optimization-config "$cfg" \
      --out "$OUT/breakdown_new_spec_$name.json" 2>&1 | grep -v Warn \
      | grep -E "ms/step synced|device:|a replay" | tee -a "$OUT/abnew.log"
  done
fi
if [[ $STAGES == *ablation* ]]; then   # W1 switches (issue 7): all-on, all-off, one-off runs
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  timeout ${ABLATION_TIMEOUT:-560} python3 benchmarks/ablation.py /tmp/k48 --workload W1 \
    --draft-model /tmp/k48-draft --out-dir "$OUT/ablation" ${ABLATION_ARGS:-} 2>&1 \
    | grep -v Warning | tail -30 | tee "$OUT/ablation.log"
fi
if [[ $STAGES == *firststeps* ]]; then   # which steps JIT-compile or autotune on first use
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  timeout ${FIRSTSTEPS_TIMEOUT:-300} python3 benchmarks/first_steps.py /tmp/k48 \
    --out "$OUT/first_steps.json" ${FIRSTSTEPS_ARGS:-} 2>&1 | grep -v Warning | tail -150 \
    | tee "$OUT/first_steps.log"
fi
if [[ $STAGES == *coldstart* ]]; then   # engine start on an empty Triton cache: fla autotuning, then stored fla configs
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  [[ ${COLD_MODEL:-} == /tmp/k12 ]] && make_k12
  python3 benchmarks/bench_compile_pool.py --workers ${COLD_WORKERS:-15} \
    --out "$OUT/compile_pool.json" 2>&1 | tail -1 | tee "$OUT/coldstart.log"
  cold_start() {   # $1: the JSON's tag; the rest: more first_steps.py arguments; COLD_CACHE:
    local tag=$1; shift   # the run's Triton cache (default a fresh one)
    TRITON_CACHE_DIR=${COLD_CACHE:-$(mktemp -d)} timeout ${COLDSTART_TIMEOUT:-280} python3 benchmarks/first_steps.py \
      ${COLD_MODEL:-/tmp/k48} --waves "" ${COLD_ARGS:-} --out "$OUT/coldstart_$tag.json" "$@" 2>&1 \
      | grep -E "engine start|fla configs|compile ahead" | tee -a "$OUT/coldstart.log"
  }
  # the baseline: fla autotunes every kernel (a user's FLA_CACHE_MODE wins over the stored
  # configs); its choices are written where kdaserve ships them, so the next runs read them
  FLA_CACHE_MODE=disabled cold_start autotune --compile-workers 0 \
    --dump-fla-configs kdaserve/kernels/configs/fla
  cp -r kdaserve/kernels/configs/fla "$OUT/fla_configs"
  [[ ${COLD_SKIP_STORED:-0} == 1 ]] || cold_start stored --compile-workers 0
  # and kdaserve's kernel variants compiled by a pool of processes (compile_workers), into the
  # default cache (emptied first), which SAVE_TCACHE then returns for later calls
  rm -rf ~/.triton/cache && mkdir -p ~/.triton/cache
  COLD_CACHE=$HOME/.triton/cache cold_start pool --compile-workers ${COLD_WORKERS:-15}
fi
if [[ $STAGES == *mixed* ]]; then   # served step compositions: prompts among decodes, bursts
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  timeout ${MIXED_TIMEOUT:-400} python3 benchmarks/bench_mixed.py /tmp/k48 \
    ${MIXED_ARGS:---decodes 16,63 --bursts 16,16 --profile} --out "$OUT/mixed.json" 2>&1 \
    | grep -v Warning | grep -v "^USDT" | tail -60 | tee "$OUT/mixed.log"
fi
if [[ $STAGES == *chain* ]]; then   # decode kernels as chains of pdl calls (bench_chain.py)
  timeout ${CHAIN_TIMEOUT:-500} python3 benchmarks/bench_chain.py --out "$OUT/chain.json" \
    ${CHAIN_ARGS:-} 2>&1 | tail -${CHAIN_TAIL:-60} | tee "$OUT/chain.log"
fi
if [[ $STAGES == *gaps* ]]; then   # prefill forward: kernels, idle gaps, host syncs (GAPS_CONFIGS)
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  [[ ${GAPS_MODEL:-} == /tmp/k12 ]] && make_k12   # GAPS_MODEL=/tmp/k12 on an H100
  i=0; for cfg in ${GAPS_CONFIGS:-"{}"}; do i=$((i+1))
    timeout ${GAPS_TIMEOUT:-150} python3 benchmarks/prefill_gaps.py ${GAPS_MODEL:-/tmp/k48} --optimization-config "$cfg" \
      --out "$OUT/gaps_$i.json" 2>&1 | grep -v Warn | tail -40 | tee -a "$OUT/gaps.log"
  done
fi
if [[ $STAGES == *batch* ]]; then   # decode kernels at batch 16-64 and the prefill MoE (bench_batch.py)
  timeout ${BATCH_TIMEOUT:-400} python3 benchmarks/bench_batch.py --out "$OUT/batch.json" ${BATCH_ARGS:-} \
    2>&1 | grep -v Warn | tail -60 | tee "$OUT/batch.log"
fi
if [[ $STAGES == *offload* ]]; then   # W2-shaped offload tier: cold / device / host / disk hit TTFT
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  timeout ${OFFLOAD_TIMEOUT:-360} python3 benchmarks/bench_offload.py /tmp/k48 --disk /tmp/offload \
    --out "$OUT/offload.json" ${OFFLOAD_ARGS:-} 2>&1 | grep -v Warn | tail -60 | tee "$OUT/offload.log"
fi
if [[ $STAGES == *router* ]]; then   # the router's fp32 logits: router_partials / cuBLAS / router_logits
  timeout ${ROUTER_TIMEOUT:-200} python3 benchmarks/bench_prefill.py --cases router \
    --tokens ${ROUTER_TOKENS:-3,9,16,64,144,288,1023,2048} --time-budget 150 --out "$OUT/router.json" \
    2>&1 | grep -v Warn | tail -80 | tee "$OUT/router.log"
fi
if [[ $STAGES == *pkernels* ]]; then   # prefill kernels and their candidates (bench_prefill.py)
  timeout ${PKERNELS_TIMEOUT:-200} python3 benchmarks/bench_prefill.py --cases ${PKERNELS_CASES:-conv,mla_attn} \
    --tokens ${PKERNELS_TOKENS:-2048,8000} --time-budget 150 --out "$OUT/pkernels.json" \
    2>&1 | grep -v Warn | tail -60 | tee "$OUT/pkernels.log"
fi
if [[ $STAGES == *sampling* ]]; then   # the engine's samplers: sort, threshold, threshold + race
  timeout ${SAMPLING_TIMEOUT:-150} python3 benchmarks/bench_sampler.py --batches ${SAMPLER_BATCHES:-1,16,64,144} \
    --out "$OUT/sampler.json" 2>&1 | tail -40 | tee "$OUT/sampler.log"
fi
if [[ $STAGES == *topp* ]]; then   # the top-p threshold search at decode and verify rows, by search tiles
  timeout ${TOPP_TIMEOUT:-150} python3 benchmarks/bench_top_p.py --batches ${TOPP_BATCHES:-1,16,144} \
    --tiles ${TOPP_TILES:-64x1,128x1,128x2,512x4,1024x8} --out "$OUT/top_p.json" 2>&1 \
    | grep -v Warn | tail -60 | tee "$OUT/top_p.log"
fi
if [[ $STAGES == *layers* ]]; then
  timeout 200 python3 benchmarks/bench_layers.py --out "$OUT/layers.json" 2>&1 | tail -30 | tee "$OUT/layers.log"
fi
[[ $STAGES == *tests* && $STAGES != tests* ]] && run_tests   # "tests" not first: run last
if [ -d ~/.triton/cache ] && [ "${SAVE_TCACHE:-1}" = 1 ]; then
  tar -cJf - -C ~/.triton cache | split -b 15M - "$OUT/triton.tar.xz." && ls -la "$OUT"/triton.tar.xz.*
fi
if [ "${PACK:-0}" = 1 ]; then   # at most 8 files come back: everything else in one archive
  (cd "$OUT" && tar czf /tmp/results.tgz --exclude='triton.tar.xz.*' . \
    && find . -mindepth 1 -not -name 'triton.tar.xz.*' -delete && mv /tmp/results.tgz .)
  ls -la "$OUT"
fi
