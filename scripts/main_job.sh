#!/usr/bin/env bash
# The main job on the CPU. `make run` passes the real model's settings (the Makefile says which);
# `make run-small` uses the defaults below, on the embedded SmolLM2-135M:
#   1. calibrate TriAttention's pre-RoPE query statistics (dev-split text, never confirm),
#   2. run alpha (lambda 0.5) and triattention at a measured mean cache of BUDGET tokens on the first
#      PROBLEMS dev problems, greedy, batched (16 sequences per step, continuously refilled), with the
#      fidelity proxy (per-step KL and top-1 agreement vs the full cache along the same tokens), and
#      the full cache as the reference row, each record with its cache trace (--trace: what the cache
#      held at every compaction; docs/records.md),
#   3. report: paired statistics, CSV, LaTeX, PNG, a table on the terminal, and the exploratory
#      paired test on the fidelity proxy (mean KL, first divergence step; alpha vs triattention),
#   4. the viewer (`retention view`): a static site of the runs, problem by problem, in $OUT/viewer.
# With DEADLINE (a Unix time; `make run` sets it 10 minutes after make started), the job is sized to
# this host after calibrating: `retention size` measures a decode step and the runs take the largest
# problem count and token limit, at most PROBLEMS and TOKENS, predicted to finish before it (the
# terminal and the report say so). Answers stay at least as long as the model's solved answers in the
# committed runs under SOLVED_FROM needed (their median): the fidelity proxy, then problems, go first;
# only when nothing fits that way are answers cut shorter (the note says no accuracy signal is expected).
# SmolLM2-135M cannot solve MATH problems (accuracy ~0 for every arm; the fidelity columns are what it
# measures); Qwen2.5-Coder-0.5B solves some. Real R1 models: see docs/gpu.md.
set -euo pipefail
RETENTION=${1:-retention}
OUT=${2:-results/demo}
MODEL=${MODEL:-smollm2-135m}
PROBLEMS=${PROBLEMS:-32}
TOKENS=${TOKENS:-160}
BATCH=${BATCH:-16}
BUDGET=${BUDGET:-64}
DTYPE=${DTYPE:-bfloat16}  # bf16 decodes ~1.6x faster than fp32 on these CPUs
SOLVED_FROM=${SOLVED_FROM:-results}  # committed runs: how long the model's solved answers were

start=$(date +%s)
# Calibrate once; the statistics file is reused by later runs (delete it to recalibrate).
stats="$OUT/stats-$MODEL.safetensors"
if [ ! -f "$stats" ]; then
  "$RETENTION" calibrate --model "$MODEL" --dtype "$DTYPE" --out "$stats"
fi
# Size the job to this host when a deadline is set (its note lands in the runs folder, where the report reads it).
note="$OUT/runs/sizing.json"
if [ -n "${DEADLINE:-}" ]; then
  sized=$("$RETENTION" size --model "$MODEL" --dtype "$DTYPE" --limit "$PROBLEMS" --seconds "$(( DEADLINE - $(date +%s) ))" \
    --max-new-tokens "$TOKENS" --batch-size "$BATCH" --retention-arms 2 --full-arms 1 --commands 2 --out "$note" \
    $([ -d "$SOLVED_FROM" ] && echo --solved-from "$SOLVED_FROM"))
  read -r PROBLEMS TOKENS FIDELITY <<< "$sized"
else
  FIDELITY=fidelity
  rm -f "$note"  # an earlier sized job's note would misstate this one
fi
common=(--model "$MODEL" --dtype "$DTYPE" --limit "$PROBLEMS" --max-new-tokens "$TOKENS" --temperature 0 \
  --batch-size "$BATCH" --out "$OUT/runs" --trace)
# The two retention arms, paired (same problems, same seeds), each also decoded with the full cache
# along its own tokens for the fidelity proxy.
"$RETENTION" run "${common[@]}" --scorer alpha --baseline triattention --param alpha.lam=0.5 --budget "$BUDGET" \
  --stats "$stats" $([ "$FIDELITY" = fidelity ] && echo --fidelity)
# The reference row: no eviction (its fidelity is exact by construction, so it is not recomputed).
"$RETENTION" run "${common[@]}" --scorer full
"$RETENTION" report "$OUT/runs" --baseline triattention --out "$OUT/report"
# The viewer: a static site over the runs (open it from the file system; docs/viewer.md).
"$RETENTION" view "$OUT/runs" --baseline triattention --out "$OUT/viewer"
echo "main job finished in $(( $(date +%s) - start )) s; report in $OUT/report"
echo "viewer: $OUT/viewer/index.html"
