#!/usr/bin/env bash
# The design space at power on Qwen2.5-Coder-1.5B (issue 44, item 3): every intervention family against
# TriAttention at one mean cache of BUDGET tokens (chosen from scripts/budget_ladder_1p5b.sh: where the full
# cache's accuracy is neither kept nor lost), on the first PROBLEMS (>= 128) dev problems of MATH-500 under
# the protocol's sampling (temperature 0.6, top-p 0.95, one sample, seeded per problem), with cache traces.
# Arms: full; scoring (TriAttention, alpha at lambda 0.5, the random control random-pp, SnapKV, R-KV, H2O);
# routing (PyramidKV, AdaKV); state (int8 quant at the same bytes, merge); cadence (newline); decoding
# (loop-guard); and the prompt axis: TriAttention and alpha with the prompt kept inside b (the protocol's
# meter, `--prompt-rule keep`) and, labelled as the peers' convention, on top of b (`--prompt-rule
# keep-on-top`: its memory is b + the prompt; the report marks those comparisons MIXED). At BUDGET 128 (b = 63
# in mean accounting) a counted prompt of about 63 tokens leaves one scored slot: the prompt arms need 256 or more.
# Each arm is its own resumable command (scripts/arm.sh): stop anywhere, rerun, finished records are skipped;
# commit each arm's records as it finishes. `timings.tsv` says how long each ran; ARMS="a b" runs only those.
#   BUDGET=256 OUT=results/design-space-qwen1.5b bash scripts/design_space_1p5b.sh
#   retention report OUT/runs --baseline triattention --out OUT/report
# Sizing: at 64 slots this model decodes about 140 output tokens/s here at a 128-token cache, 75 with the
# full cache (results/dev-qwen1.5b/); 17 arms x 128 problems x 1024 tokens is about 5-8 h of decode.
set -euo pipefail
RETENTION=${RETENTION:-.venv/bin/retention}
MODEL=${MODEL:-qwen2.5-coder-1.5b}
OUT=${OUT:-results/design-space-qwen1.5b}
PROBLEMS=${PROBLEMS:-128}
TOKENS=${TOKENS:-1024}
BATCH=${BATCH:-64}
BUDGET=${BUDGET:?choose it from the budget ladder (scripts/budget_ladder_1p5b.sh), e.g. BUDGET=256}
STATS=${STATS:-results/dev-qwen1.5b/stats-$MODEL.safetensors}
KIB_PER_TOKEN=${KIB_PER_TOKEN:-28}  # this model's bf16 cache: 28 layers x 2 KV heads x 128 dims x (K, V) x 2 bytes
KIB=$(( BUDGET * KIB_PER_TOKEN ))   # the quant arm holds the bytes of BUDGET full-precision tokens
[ -f "$STATS" ] || { echo "no statistics at $STATS (retention calibrate --model $MODEL --dtype bfloat16 --out $STATS)" >&2; exit 2; }
mkdir -p "$OUT"
common=(--model "$MODEL" --dtype bfloat16 --limit "$PROBLEMS" --max-new-tokens "$TOKENS" --temperature 0.6 --top-p 0.95
        --batch-size "$BATCH" --trace --out "$OUT/runs" --quiet)
source "$(dirname "$0")/arm.sh"
tri=(--scorer triattention --stats "$STATS")
al=(--scorer alpha --lambda 0.5 --stats "$STATS")
b=$BUDGET
arm "triattention-$b" "${tri[@]}" --budget "$b"                                   # the baseline
arm "alpha-$b" "${al[@]}" --budget "$b"                                           # scoring
arm "random-pp-$b" --scorer random-pp --budget "$b"                               # scoring: the random control
arm "snapkv-$b" --scorer snapkv --budget "$b"                                     # scoring
arm "rkv-$b" --scorer rkv --budget "$b"                                           # scoring
arm "h2o-$b" --scorer h2o --budget "$b"                                           # scoring
arm "pyramidkv-$b" "${tri[@]}" --budget "$b" --routing pyramidkv                  # routing
arm "adakv-$b" "${tri[@]}" --budget "$b" --routing adakv                          # routing
arm "quant-int8-same-bytes-$b" "${tri[@]}" --budget-bytes "$KIB" --state quant --param quant.keys=token  # state
arm "merge-$b" "${tri[@]}" --budget "$b" --state merge                            # state
arm "newline-$b" "${tri[@]}" --budget "$b" --cadence newline                      # cadence
arm "loop-guard-$b" "${tri[@]}" --budget "$b" --decoding loop-guard               # decoding
arm "triattention-pp-in-$b" "${tri[@]}" --budget "$b" --prompt-rule keep          # prompt, counted
arm "alpha-pp-in-$b" "${al[@]}" --budget "$b" --prompt-rule keep                  # prompt, counted
arm "triattention-pp-top-$b" "${tri[@]}" --budget "$b" --prompt-rule keep-on-top  # prompt, peers' convention
arm "alpha-pp-top-$b" "${al[@]}" --budget "$b" --prompt-rule keep-on-top          # prompt, peers' convention
arm full --scorer full                                                            # the reference
