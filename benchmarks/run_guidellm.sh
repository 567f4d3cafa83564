#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run guidellm 0.8.1 (pinned) against a running OpenAI-compatible server (`kdaserve serve` or
# `vllm serve`) on loopback: concurrent profile, synthetic prompts, bounded request count.
# Exits non-zero if any request errored.
#
#   benchmarks/run_guidellm.sh [--target URL] [--streams N] [--requests N (0: no count limit)]
#       [--max-seconds S] [--max-errors N] [--seed N] [--temperature T] [--top-p P]
#       [--prompt-tokens N] [--output-tokens N] [--api-key KEY] [--out DIR] [--tokenizer PATH]
#
# guidellm lives in its own venv ($GUIDELLM_VENV, default ~/.cache/kdaserve/guidellm-venv).
# torch is a hard dependency of guidellm: the CPU build is installed first so pip never pulls
# the multi-GB CUDA one. GUIDELLM_REUSE_SITE=/path/to/site-packages reuses an existing torch +
# transformers instead (same Python version), e.g. the kdaserve venv's. GUIDELLM_WHEELS=DIR
# installs offline, without dependency resolution, every wheel in DIR (guidellm and what the
# reused site lacks: benchmarks/multi_gpu.sh says how that folder is made).
set -euo pipefail

GUIDELLM_VERSION=0.8.1
TORCH_VERSION=2.13.0
VENV=${GUIDELLM_VENV:-$HOME/.cache/kdaserve/guidellm-venv}
PYTHON=${PYTHON:-python3}

TARGET=http://127.0.0.1:8000
STREAMS=4
REQUESTS=40
MAX_SECONDS=""
MAX_ERRORS=""
SEED=""
TEMPERATURE=""
TOP_P=""
PROMPT_TOKENS=64
OUTPUT_TOKENS=16
API_KEY=""
OUT=./guidellm-results
TOKENIZER=""

while [ $# -gt 0 ]; do
  case "$1" in
    --target) TARGET=$2; shift 2 ;;
    --streams) STREAMS=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --max-seconds) MAX_SECONDS=$2; shift 2 ;;
    --max-errors) MAX_ERRORS=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --temperature) TEMPERATURE=$2; shift 2 ;;
    --top-p) TOP_P=$2; shift 2 ;;
    --prompt-tokens) PROMPT_TOKENS=$2; shift 2 ;;
    --output-tokens) OUTPUT_TOKENS=$2; shift 2 ;;
    --api-key) API_KEY=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --tokenizer) TOKENIZER=$2; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "run_guidellm.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

# --- install (once) -------------------------------------------------------------------------
GUIDELLM=("$VENV/bin/python" -m guidellm)
if ! "${GUIDELLM[@]}" --version 2>/dev/null | grep -q "$GUIDELLM_VERSION"; then
  echo "installing guidellm $GUIDELLM_VERSION into $VENV" >&2
  # a Python without ensurepip (Debian's without python3-venv) makes the venv without pip;
  # $PYTHON's own pip then installs into it
  "$PYTHON" -m venv "$VENV" 2>/dev/null || "$PYTHON" -m venv --without-pip "$VENV"
  PIP=("$VENV/bin/python" -m pip)
  "${PIP[@]}" --version >/dev/null 2>&1 || PIP=("$PYTHON" -m pip --python "$VENV/bin/python")
  if [ -n "${GUIDELLM_REUSE_SITE:-}" ]; then
    SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$GUIDELLM_REUSE_SITE" > "$SITE/_kdaserve_reuse.pth"
  else
    "${PIP[@]}" install --quiet "torch==$TORCH_VERSION" \
      --index-url https://download.pytorch.org/whl/cpu
  fi
  if [ -n "${GUIDELLM_WHEELS:-}" ]; then
    "${PIP[@]}" install --quiet --no-index --no-deps "$GUIDELLM_WHEELS"/*.whl
  else
    "${PIP[@]}" install --quiet "guidellm==$GUIDELLM_VERSION"
  fi
fi

# --- the served model: id for requests, root (local path) for the tokenizer -------------------
AUTH=()
[ -n "$API_KEY" ] && AUTH=(-H "Authorization: Bearer $API_KEY")
MODELS=$(curl -sf "${AUTH[@]}" "$TARGET/v1/models")
MODEL_ID=$(echo "$MODELS" | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
# kdaserve's root is the served name, not a path: pass --tokenizer MODEL_FOLDER for it
MODEL_ROOT=${TOKENIZER:-$(echo "$MODELS" | "$VENV/bin/python" -c 'import json,sys; d=json.load(sys.stdin)["data"][0]; print(d.get("root") or d["id"])')}

BACKEND="kind=openai_http,target=$TARGET,model=$MODEL_ID"
[ -n "$API_KEY" ] && BACKEND="$BACKEND,api_key=$API_KEY"
[ -n "$TEMPERATURE" ] && BACKEND="$BACKEND,extras.body.temperature=$TEMPERATURE"
[ -n "$TOP_P" ] && BACKEND="$BACKEND,extras.body.top_p=$TOP_P"
LIMITS=()
[ "$REQUESTS" != 0 ] && LIMITS+=(--constraint "kind=max_requests,count=$REQUESTS")
[ -n "$MAX_SECONDS" ] && LIMITS+=(--constraint "kind=max_duration,seconds=$MAX_SECONDS")
[ -n "$MAX_ERRORS" ] && LIMITS+=(--constraint "kind=max_errors,count=$MAX_ERRORS")
[ -n "$SEED" ] && LIMITS+=(--seed "kind=static,value=$SEED")
mkdir -p "$OUT"

# --- run, offline, loopback only ------------------------------------------------------------
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 GUIDELLM__DEFAULT_RESULTS_DIR="$OUT" \
"${GUIDELLM[@]}" run \
  --backend "$BACKEND" \
  --profile "kind=concurrent,streams=$STREAMS" \
  "${LIMITS[@]}" \
  --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
  --tokenizer "kind=huggingface_auto,model=$MODEL_ROOT" \
  --output "kind=json,path=$OUT/guidellm.json" \
  --output "kind=csv,path=$OUT/guidellm.csv" \
  --disable-console-interactive

# --- verdict: every request must have succeeded -------------------------------------------------
"$VENV/bin/python" - "$OUT/guidellm.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
bad = 0
for bench in report["benchmarks"]:
    reqs = bench["requests"]
    ok, err, inc = (len(reqs.get(k) or []) for k in ("successful", "errored", "incomplete"))
    bad += err
    m = bench["metrics"]
    ttft = m["time_to_first_token_ms"]["successful"]["median"]
    itl = m["inter_token_latency_ms"]["successful"]["median"]
    print(f"guidellm: {ok} successful, {err} errored, {inc} incomplete; "
          f"median TTFT {ttft:.1f} ms, median ITL {itl:.2f} ms")
sys.exit(1 if bad else 0)
PY
