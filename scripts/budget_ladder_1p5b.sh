#!/usr/bin/env bash
# The budget ladder for the 1.5B design space (issue 44, item 3): TriAttention, alpha (lambda 0.5) and the
# random control (random-pp) at mean caches of BUDGETS tokens, and the full cache, on the first PROBLEMS dev
# problems of MATH-500 under the protocol's sampling (temperature 0.6, top-p 0.95, one sample, seeded per
# problem), with cache traces (prompt retention, the first compaction's step). The design space then runs at
# the budget where the full cache's accuracy is neither kept nor lost (docs/random-control.md). Each arm is
# its own resumable command (scripts/arm.sh): stop anywhere, rerun, finished records are skipped;
# `timings.tsv` says how long each ran. ARMS="a b" runs only the named arms.
#   OUT=results/ladder-qwen1.5b bash scripts/budget_ladder_1p5b.sh
#   retention report OUT/runs --baseline full --out OUT/report        # accuracy, truncation, diagnostics
# Sizing (measured 2026-12-03 on this host, results/dev-qwen1.5b/: 64 problems x 768 tokens took 339-456 s per
# arm at 64 slots, 75-147 output tok/s): 10 arms x 64 problems at 1024 tokens is about 1.5-2 h of decode.
# random-pp keeps a 64-token window inside b and the prompt after it: at BUDGET 128 (b = 95 in mean
# accounting) it protects only the first 30 prompt tokens; from 256 on the whole prompt of these problems.
set -euo pipefail
RETENTION=${RETENTION:-.venv/bin/retention}
MODEL=${MODEL:-qwen2.5-coder-1.5b}
OUT=${OUT:-results/ladder-qwen1.5b}
PROBLEMS=${PROBLEMS:-64}
TOKENS=${TOKENS:-1024}   # the full cache truncates 28% of answers at 768 (results/dev-qwen1.5b/)
BATCH=${BATCH:-64}
BUDGETS=${BUDGETS:-128 256 512}
STATS=${STATS:-results/dev-qwen1.5b/stats-$MODEL.safetensors}
mkdir -p "$OUT"
if [ ! -f "$STATS" ]; then
  start=$(date +%s)
  "$RETENTION" calibrate --model "$MODEL" --dtype bfloat16 --out "$STATS"
  printf 'calibrate\t%s\n' "$(( $(date +%s) - start ))" >> "$OUT/timings.tsv"
fi
common=(--model "$MODEL" --dtype bfloat16 --limit "$PROBLEMS" --max-new-tokens "$TOKENS" --temperature 0.6 --top-p 0.95
        --batch-size "$BATCH" --trace --out "$OUT/runs" --quiet)
source "$(dirname "$0")/arm.sh"
arm full --scorer full
for b in $BUDGETS; do
  arm "triattention-$b" --scorer triattention --stats "$STATS" --budget "$b"
  arm "alpha-$b" --scorer alpha --lambda 0.5 --stats "$STATS" --budget "$b"
  arm "random-pp-$b" --scorer random-pp --budget "$b"
done
