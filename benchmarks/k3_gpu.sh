#!/usr/bin/env bash
# Kimi K3 (issue 22) on one H200, one device call: run from the repo root; logs and JSON land
# in $OUT (default /tmp/out). Wheels for the offline GPU image as for gpu_checks.sh (.whl,
# carried); .tcache/triton.tar.xz.* restores a Triton cache when carried.
#
# STAGES (comma list, default tests,bench,kl):
#   tests  the K3 GPU tests: every new Triton kernel against its twin (bf16 bound 1e-2), the
#          latent MoE layer per backend x expert format, the kimi-k3-tiny model on CUDA
#          (prefill and decode steps, K3 kernels on and off)
#   count  benchmarks/count_ops.py on kimi-k3-mini: aten ops and Triton launches per piece of
#          one eager batch-1 decode step, the K3 pieces' kernels off then on
#   tiles  (runs before bench, so bench times the tiles it writes; text below)
#   gemv   benchmarks/bench_chain.py over kimi-k3-mini's decode projections (K3_GEMV_SHAPES),
#          graph-chained PDL calls; each shape's fastest config merged into
#          kdaserve/kernels/configs/gemv_device_name=GPU.json where it beats today's by > 2%
#          (--write-configs; $OUT/configs.tgz), so bench runs with them; ~GEMV_BUDGET s
#   bench  benchmarks/bench_k3.py ${BENCH_ARGS:---stages decode,profile} on kimi-k3-mini (dummy weights made
#          on the GPU): batch-1 decode at 8000 tokens of context with CUDA graphs, MXFP4 vs bf16
#          experts (ratio, step floor), MXFP4 unfused tail, both MXFP4 tails without PDL; the
#          profile (top kernels by device time; fused, unfused, bf16)
#   tiles  benchmarks/bench_mxfp4_tiles.py: the latent-MoE kernels' tile candidates at decode
#          sizes (TILE_TOKENS, default 1,4,16; MXFP4 and bf16) against their floors and the
#          unfused tail, into $OUT/mxfp4_tiles.json; the winners are merged into the config
#          files in kdaserve/kernels/configs (--write-configs; $OUT/configs.tgz), so the stages after it
#          (kl, serve) run with them. A cold sweep compiles ~140 kernels a format:
#          give it a call of its own (TILE_TOKENS / TILE_EXPERTS narrow it)
#   kl     bench_k3.py --stages kl: mean KL(bf16 || MXFP4) on kimi-k3-mini, KL_PROMPTS x
#          KL_LEN (default 64 x 128)
#   serve  W1-nospec served (kdaserve serve kimi-k3-mini --load-format dummy), concurrency
#          1/4/16 through benchmarks/seed_table.py (a separate call: ~10 min alone)
# bench and kl write $OUT/k3_h200.json (one key per stage; copy it to
# benchmarks/results/k3_h200.json). SAVE_TCACHE=1 writes the Triton cache back into $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
if ls .tcache/triton.tar.xz.* >/dev/null 2>&1; then
  mkdir -p ~/.triton && cat .tcache/triton.tar.xz.* | tar -xJf - -C ~/.triton && echo "triton cache restored"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
STAGES=${STAGES:-tests,bench,kl}
MODEL=${MODEL:-/tmp/k3mini}
JSON="$OUT/k3_h200.json"
cli() { python3 -m kdaserve.entrypoints.cli "$@"; }
make_mini() { [[ -f $MODEL/config.json ]] || cli make-model "$MODEL" --preset kimi-k3-mini >/dev/null; }
t0=$SECONDS
if [[ $STAGES == *tests* ]]; then
  timeout ${TESTS_TIMEOUT:-360} python3 -m pytest -v -p no:cacheprovider -m gpu \
    tests/kernels/test_mxfp4_moe.py tests/kernels/test_k3_ops.py \
    tests/kernels/test_kda_decode_fused.py::test_k3_matches_twin_and_layer_gpu \
    tests/kernels/test_gemv.py::test_gemv_swiglu_dense_down_gpu \
    tests/models/test_backends.py::test_latent_moe_backends_on_gpu \
    tests/models/test_k3_model.py::test_cuda_bf16_path_matches_the_cpu_reference \
    tests/models/test_k3_model.py::test_cuda_decode_steps_match_the_cpu_reference 2>&1 \
    | grep -E "PASSED|FAILED|ERROR|SKIPPED|^E  |passed|failed" | tail -80 | tee "$OUT/k3_gpu_tests.log"
  echo "tests: $((SECONDS - t0)) s"
fi
if [[ $STAGES == *count* ]]; then
  for k3 in off on; do
    timeout ${COUNT_TIMEOUT:-240} python3 benchmarks/count_ops.py --preset kimi-k3-mini \
      --device cuda --k3-kernels $k3 --out "$OUT/count_ops_k3mini_$k3.json" 2>&1 \
      | grep -v Warning | tail -30 | tee "$OUT/count_ops_$k3.log"
  done
  echo "count: $((SECONDS - t0)) s"
fi
save_configs() {   # the device tool returns no file whose name holds "=": one archive instead
  tar -czf "$OUT/configs.tgz" -C kdaserve/kernels/configs \
    $(cd kdaserve/kernels/configs && ls *_device_name=*.json 2>/dev/null)
}
if [[ $STAGES == *tiles* ]]; then
  timeout ${TILES_TIMEOUT:-480} python3 benchmarks/bench_mxfp4_tiles.py --tokens ${TILE_TOKENS:-1,4,16} \
    --experts ${TILE_EXPERTS:-mxfp4,bf16} ${TILE_ARGS:-} --out "$OUT/mxfp4_tiles.json" \
    --write-configs kdaserve/kernels/configs 2>&1 | grep -v Warning | tail -40 | tee "$OUT/k3_tiles.log"
  save_configs
  echo "tiles: $((SECONDS - t0)) s"
fi
if [[ $STAGES == *gemv* ]]; then
  # kimi-k3-mini's GEMV shapes by bytes a step: KDA in-proj, o_proj / latent down / shared
  # down, shared gate|up, MLA q_a|kv_a|gate, the fp32 router, the dense MLP, MLA q_b
  K3_GEMV_SHAPES=${K3_GEMV_SHAPES:-8336x2048,2048x2048,4096x2048,3392x2048,256x2048:fp32,8192x2048,2048x4096,3072x768}
  timeout $(( ${GEMV_BUDGET:-200} + 40 )) python3 benchmarks/bench_chain.py --cases "" \
    --gemv-shapes "$K3_GEMV_SHAPES" --m 1 --time-budget ${GEMV_BUDGET:-200} \
    --write-configs kdaserve/kernels/configs --out "$OUT/chain_k3mini.json" 2>&1 \
    | grep -E "baseline|^M=.*(write|keep)|wrote|rror" | tee "$OUT/k3_gemv.log"
  save_configs
  echo "gemv: $((SECONDS - t0)) s"
fi
if [[ $STAGES == *bench* ]]; then
  make_mini
  timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/bench_k3.py "$MODEL" ${BENCH_ARGS:---stages decode,profile} \
    --context ${CONTEXT:-8000} --steps ${STEPS:-64} --out "$JSON" 2>&1 | grep -v Warning \
    | tail -40 | tee "$OUT/k3_bench.log"
  echo "bench: $((SECONDS - t0)) s"
fi
if [[ $STAGES == *kl* ]]; then
  make_mini
  timeout ${KL_TIMEOUT:-180} python3 benchmarks/bench_k3.py "$MODEL" --stages kl \
    --kl-prompts ${KL_PROMPTS:-64} --kl-len ${KL_LEN:-128} --out "$JSON" 2>&1 | grep -v Warning \
    | tail -20 | tee "$OUT/k3_kl.log"
  echo "kl: $((SECONDS - t0)) s"
fi
if [[ $STAGES == *serve* ]]; then   # needs opentelemetry-api in .whl (as gpu_checks.sh seed)
  make_mini
  timeout ${SERVE_TIMEOUT:-590} python3 benchmarks/seed_table.py "$MODEL" --configs W1-nospec \
    --time-budget ${SERVE_BUDGET:-560} --out-dir "$OUT/seed" --tag k3mini ${SEED_ARGS:-} 2>&1 \
    | grep -v Warning | tail -25 | tee "$OUT/k3_seed.log"
fi
if [[ ${SAVE_TCACHE:-0} == 1 ]]; then
  tar -cJf - -C ~/.triton cache 2>/dev/null | split -b 16M - "$OUT/triton.tar.xz."
fi
