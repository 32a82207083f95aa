#!/usr/bin/env bash
# The confirmation on Qwen2.5-Coder-1.5B at 256 tokens (issue 44, items 4 and 5): a family of m = 2 cells,
# Bonferroni over both, each registered before any of its confirm records exist.
#   cell 1 (plan "alpha"): alpha (lambda 0.5) vs TriAttention: the alpha study's own claim (arXiv 2605.14292),
#          fixed before the sweep; registered once both dev arms (128 problems) were committed.
#   cell 2 (plan "best"): the best dev arm vs the random control `random-pp`, chosen by the rule in cell 1's
#          note (written before the confirm split was touched); registered when the dev sweep is complete.
# Each plan records the MDE of its cell from the dev arms' paired discordance (--dev, power 0.8, bound 10 pp)
# and the predicted wall time of its confirmation on this host (--time-slots 64: a short measurement).
# Run it from a clean checkout with OUT outside it (confirm refuses uncommitted changes), then copy OUT into
# results/confirm-qwen1.5b/. `confirm` resumes: rerun to go on where it stopped.
#   OUT=/work/confirm-1p5b STEP=alpha bash scripts/confirm_1p5b.sh
set -euo pipefail
RETENTION=${RETENTION:-.venv/bin/retention}
OUT=${OUT:?a folder outside the checkout}
STEP=${STEP:?alpha or best}
MODEL=qwen2.5-coder-1.5b
TOKENS=1024
STATS=results/dev-qwen1.5b/stats-$MODEL.safetensors
DEV=${DEV:-results/design-space-qwen1.5b/runs}
TIMINGS=$OUT/timings.tsv
mkdir -p "$OUT/plans" "$OUT/confirm" "$OUT/logs"
arm_json() { printf '{"scorer": "%s", "scorer_params": {%s}, "dtype": "bfloat16", "temperature": 0.6, "top_p": 0.95}' "$1" "$2"; }
tri=$(arm_json triattention "\"stats\": \"$STATS\"")
alpha=$(arm_json alpha "\"lam\": 0.5, \"stats\": \"$STATS\"")

rule="Family: m = 2 cells on $MODEL at a mean cache of 256 tokens, 299 confirm problems, k = 1, $TOKENS new tokens, \
the protocol's sampling, Bonferroni over both. Cell 1: alpha (lambda 0.5) vs TriAttention (the alpha study's claim; \
fixed before the 1.5B sweep). Cell 2, registered as its own plan when the dev sweep of results/design-space-qwen1.5b \
is complete and before any of its confirm records exist: the arm with the highest dev accuracy on the 128 dev \
problems among the sweep's matched-memory arms (every arm but full, random-pp itself and the keep-on-top prompt \
arms, whose memory is b plus the prompt), ties to the higher acc_strict, then to the earlier arm of the sweep's \
order, against random-pp (the prompt kept, a recency window, a uniform random subset of the rest per KV head)."

register() {  # name, treatment, baseline, note
  [ -s "$OUT/plans/$1.txt" ] && return
  "$RETENTION" preregister --out "$OUT/plans" --model "$MODEL" --budget 256 --treatment "$2" --baseline "$3" \
    -k 1 --max-new-tokens "$TOKENS" --m 2 --dev "$DEV" --power 0.8 --mde-bound 10 --time-slots 64 \
    --note "$4" | tee "$OUT/plans/$1.txt"
}

confirm() {  # name: confirm the plan registered under that name
  local plan start
  plan=$(grep -o "registered: .*\.json" "$OUT/plans/$1.txt" | cut -d' ' -f2)
  start=$(date +%s)
  "$RETENTION" confirm --plan "$plan" --out "$OUT/confirm" --cell "$MODEL@b256" 2>&1 | tee -a "$OUT/logs/confirm-$1.log"
  printf 'confirm-%s\t%s\n' "$1" "$(( $(date +%s) - start ))" >> "$TIMINGS"
}

case $STEP in
  alpha)
    register alpha "$alpha" "$tri" "Cell 1 of 2: alpha vs TriAttention, two-sided. $rule"
    confirm alpha ;;
  best)
    BEST=${BEST:?the arm the rule in cell 1 chose, as a JSON config}
    register best "$BEST" "$(arm_json random-pp '')" "Cell 2 of 2: the best dev arm vs random-pp, two-sided. $rule"
    confirm best ;;
  *) echo "STEP must be alpha or best" >&2; exit 2 ;;
esac
