#!/usr/bin/env bash
set -euo pipefail
cd /work/run-confirm2
for cell in qwen2.5-coder-0.5b@b128 qwen2.5-coder-0.5b@b256; do
  start=$(date +%s)
  /work/bin/retention-wt2 confirm --plan /work/fc-out/replan/plan-4e30911dba14.json --out /work/fc-out/confirm --cell "$cell" > /work/fc-out/confirm-$cell.log 2>&1
  printf 'confirm-%s\t%s\n' "$cell" "$(( $(date +%s) - start ))" >> /work/fc-out/timings.tsv
done
cd /work/run-confirm
start=$(date +%s)
/work/bin/retention-wt run --model qwen2.5-coder-0.5b --dtype bfloat16 --max-new-tokens 768 --temperature 0.6 --top-p 0.95 --batch-size 64 --out /work/fc-out/dev/runs --quiet --scorer full | tee -a /work/fc-out/dev/run.log
printf 'dev-full\t%s\n' "$(( $(date +%s) - start ))" >> /work/fc-out/timings.tsv
