#!/usr/bin/env bash
# The first real confirmation (issue 29, item 7) on Qwen2.5-Coder-0.5B-Instruct (the Q4_K_M GGUF
# dequantised to bf16), the protocol's sampling (temperature 0.6, top-p 0.95, seeded per problem),
# 768 new tokens, k = 1:
#   1. dev: TriAttention and alpha (lambda 0.5) at a measured mean cache of 128 tokens on all 201 dev
#      problems, then the full cache (the reference; last, as it is the slowest arm);
#   2. preregister alpha vs TriAttention at budgets 128 and 256 (m = 2, Bonferroni, cluster bootstrap),
#      the dev summary lines quoted in the plan's note;
#   3. confirm each cell on the 299 confirm problems (one command per cell; `confirm` resumes).
# On this project's machine the confirmation ran as plan b9c54459be6c (registered 2026-12-02 23:46 UTC,
# same arms; its records were lost with the machine) and was regenerated under plan 4e30911dba14,
# which supersedes it (results/first-confirm-qwen0.5b/README.md says how). A fresh registry runs
# the three steps as written.
# Run it from a clean checkout with OUT outside it (confirm refuses uncommitted changes and untracked
# files), then copy OUT into results/. Runs and confirm cells resume, so a rerun goes on where it stopped. `timings.tsv` holds the wall seconds of each command.
# STEPS="dev confirm full" picks steps (default: all, in the order dev, confirm, full).
set -euo pipefail
RETENTION=${RETENTION:-.venv/bin/retention}
OUT=${OUT:-../first-confirm-qwen0.5b}
MODEL=qwen2.5-coder-0.5b
TOKENS=768
BATCH=64
STATS=results/real-signal-qwen0.5b/stats-$MODEL.safetensors
STEPS=${STEPS:-dev confirm full}
mkdir -p "$OUT/dev"
common=(--model "$MODEL" --dtype bfloat16 --max-new-tokens "$TOKENS" --temperature 0.6 --top-p 0.95
        --batch-size "$BATCH" --out "$OUT/dev/runs" --quiet)
LOG=$OUT/dev/run.log
TIMINGS=$OUT/timings.tsv
source "$(dirname "$0")/arm.sh"
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has dev; then
  arm dev-triattention-128 --scorer triattention --stats "$STATS" --budget 128
  arm dev-alpha-128 --scorer alpha --lambda 0.5 --stats "$STATS" --budget 128
fi

if has confirm; then
  mkdir -p "$OUT/plans"
  if [ ! -s "$OUT/plan.txt" ]; then
    dev=$(grep -h "records, accuracy" "$LOG" | sed "s/^.*\($MODEL-[a-z]*-b[0-9]*\)-[0-9a-f]*: /\1: /" | paste -sd ';' -)
    note="alpha vs TriAttention, two-sided. lambda = 0.5 (the value every dev run used; not tuned further). Dev evidence before registration: all 201 dev problems at 768 tokens, budget 128: $dev. Earlier 64-problem dev runs: results/design-space-qwen0.5b (768 tokens) alpha - TriAttention +0.00 pp; results/real-signal-qwen0.5b-sampled (1024 tokens) +1.56 pp."
    arm_json() { printf '{"scorer": "%s", "scorer_params": {%s"stats": "%s"}, "dtype": "bfloat16", "temperature": 0.6, "top_p": 0.95}' "$1" "$2" "$STATS"; }
    "$RETENTION" preregister --out "$OUT/plans" --model "$MODEL" --budget 128 --budget 256 \
      --treatment "$(arm_json alpha '"lam": 0.5, ')" --baseline "$(arm_json triattention '')" \
      -k 1 --max-new-tokens "$TOKENS" --note "$note" | tee "$OUT/plan.txt"
  fi
  plan=$(ls "$OUT"/plans/plan-*.json | head -1)
  for cell in "$MODEL@b128" "$MODEL@b256"; do
    start=$(date +%s)
    "$RETENTION" confirm --plan "$plan" --out "$OUT/confirm" --cell "$cell" 2>&1 | tee -a "$OUT/confirm.log"
    printf 'confirm-%s\t%s\n' "$cell" "$(( $(date +%s) - start ))" >> "$TIMINGS"
  done
fi

if has full; then
  arm dev-full --scorer full
fi
