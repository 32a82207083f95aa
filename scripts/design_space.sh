#!/usr/bin/env bash
# The design-space run (issue 27, item 6): one arm per intervention family against TriAttention at a
# measured mean cache of 128 tokens on Qwen2.5-Coder-0.5B-Instruct (the Q4_K_M GGUF dequantised to
# bf16), MATH-500 dev, the protocol's sampling (temperature 0.6, top-p 0.95, seeded per problem),
# fidelity on. Each arm is its own command: stop anywhere and rerun (runs resume); `timings.tsv`
# says how long each arm's command ran. ARMS="a b" runs only the named arms.
# Report: retention report OUT/runs --baseline triattention --out OUT/report
set -euo pipefail
RETENTION=${RETENTION:-.venv/bin/retention}
OUT=${OUT:-results/design-space-qwen0.5b}
MODEL=${MODEL:-qwen2.5-coder-0.5b}
PROBLEMS=${PROBLEMS:-64}
TOKENS=${TOKENS:-768}
BATCH=${BATCH:-64}
STATS=${STATS:-results/real-signal-qwen0.5b/stats-$MODEL.safetensors}
KIB=${KIB:-1536}  # 128 tokens of this model's full-precision cache (12 KiB per token in bf16)
mkdir -p "$OUT"
common=(--model "$MODEL" --dtype bfloat16 --limit "$PROBLEMS" --max-new-tokens "$TOKENS" --temperature 0.6 --top-p 0.95
        --batch-size "$BATCH" --out "$OUT/runs" --quiet)
source "$(dirname "$0")/arm.sh"
tri=(--scorer triattention --stats "$STATS" --fidelity)
arm triattention-128 "${tri[@]}" --budget 128                                   # the baseline
arm alpha-128 --scorer alpha --lambda 0.5 --stats "$STATS" --fidelity --budget 128  # scoring
arm quant-int8-same-bytes "${tri[@]}" --budget-bytes "$KIB" --state quant --param quant.keys=token  # state
arm pyramidkv-128 "${tri[@]}" --budget 128 --routing pyramidkv                  # routing
arm adakv-128 "${tri[@]}" --budget 128 --routing adakv                          # routing
arm merge-128 "${tri[@]}" --budget 128 --state merge                            # state
arm newline-128 "${tri[@]}" --budget 128 --cadence newline                      # cadence
arm loop-guard-128 "${tri[@]}" --budget 128 --decoding loop-guard               # decoding
arm full --scorer full                                                          # the reference
# The iso-cache diagnostic (the same arms under `prefill` accounting, where b is B itself and the mean
# cache is larger): run only when named in ARMS (scripts/design_space_prefill.sh names them all).
if [ -n "${ARMS:-}" ]; then
  # The arms above ran before sampling moved to inverse CDF (their configurations have no `sampler`):
  # draw as they did, so that an arm and its iso-cache twin differ in the accounting alone.
  pre=(--accounting prefill --sampler multinomial)
  arm triattention-128-prefill "${tri[@]}" "${pre[@]}" --budget 128
  arm alpha-128-prefill --scorer alpha --lambda 0.5 --stats "$STATS" --fidelity "${pre[@]}" --budget 128
  arm pyramidkv-128-prefill "${tri[@]}" "${pre[@]}" --budget 128 --routing pyramidkv
  arm adakv-128-prefill "${tri[@]}" "${pre[@]}" --budget 128 --routing adakv
  arm merge-128-prefill "${tri[@]}" "${pre[@]}" --budget 128 --state merge
  arm newline-128-prefill "${tri[@]}" "${pre[@]}" --budget 128 --cadence newline
  arm loop-guard-128-prefill "${tri[@]}" "${pre[@]}" --budget 128 --decoding loop-guard
  arm quant-int8-same-bytes-prefill "${tri[@]}" "${pre[@]}" --budget-bytes "$KIB" --state quant --param quant.keys=token
fi
