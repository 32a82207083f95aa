#!/usr/bin/env bash
# A study as a Slurm job array: array task I runs shard I of N of the same `retention run`.
#
#   sbatch --array=0-7 scripts/slurm_array.sh results/dev --model r1-distill-qwen-7b --dtype bfloat16 \
#       --scorer alpha --baseline triattention --budget 128 --samples 4 --max-new-tokens 8192
#
# OUT (the first argument) must be on a file system all nodes share: every task writes its own
# records.shard-I-of-N.jsonl in the same run directories. The array must be indexed from 0
# (--array=0-(N-1)); `--shard auto` reads SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT.
# A task that died (preempted, timed out) resumes from its records when resubmitted:
#   sbatch --array=3 scripts/slurm_array.sh ...same arguments...
# `retention report OUT` reads the sharded directories as they are; to get the layout of an
# unsharded run, merge once every task is done, e.g. as a dependent job:
#   sbatch --dependency=afterok:<array job id> --wrap "retention merge OUT --out OUT-merged"
#SBATCH --job-name=retention
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=4
#SBATCH --time=24:00:00
#SBATCH --output=retention-%A_%a.out
set -euo pipefail
out="${1:?usage: sbatch --array=0-<N-1> scripts/slurm_array.sh OUT [retention run options]}"
shift
exec "${RETENTION:-retention}" run "$@" --out "$out" --shard auto --device "${DEVICE:-cuda}" --quiet
