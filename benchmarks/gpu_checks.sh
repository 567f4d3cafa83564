#!/usr/bin/env bash
# One device call: GPU tests + layer and engine benchmarks on the H200. Run from the repo root
# with .whl carried (see ../shared/tools/gpu-wheels.sh); results land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
STAGES=${STAGES:-tests,engine,layers}
if [[ $STAGES == *tests* ]]; then
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests} 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
fi
if [[ $STAGES == *engine* ]]; then
  python3 -m kdaserve.entrypoints.cli make-model /tmp/k48 --preset kimi-linear-48b-a3b >/dev/null
  timeout ${ENGINE_TIMEOUT:-400} python3 benchmarks/bench_engine.py /tmp/k48 --out "$OUT/engine.json" ${ENGINE_ARGS:-} 2>&1 \
    | grep -v Warning | tail -30 | tee "$OUT/engine.log"
fi
if [[ $STAGES == *layers* ]]; then
  timeout 200 python3 benchmarks/bench_layers.py --out "$OUT/layers.json" 2>&1 | tail -30 | tee "$OUT/layers.log"
fi
