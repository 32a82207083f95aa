# Sourced by the results scripts (real_signal.sh, design_space.sh, first_confirm.sh): run one arm, log it, time it.
# Needs RETENTION (the CLI), OUT (the results folder) and the array `common` (options of every arm);
# ARMS="a b" runs only the arms so named. The run summaries go to LOG (default OUT/run.log), the
# seconds of each arm to TIMINGS (default OUT/timings.tsv).
arm() {  # name, then the run options of the arm
  local name=$1; shift
  if [ -n "${ARMS:-}" ] && [[ " $ARMS " != *" $name "* ]]; then return; fi
  local start=$(date +%s)
  "$RETENTION" run "${common[@]}" "$@" | tee -a "${LOG:-$OUT/run.log}"
  printf '%s\t%s\n' "$name" "$(( $(date +%s) - start ))" >> "${TIMINGS:-$OUT/timings.tsv}"
}
