#!/usr/bin/env bash
# The iso-cache diagnostic of the design-space run: every arm of scripts/design_space.sh again under
# `prefill` accounting (b = B: the kept count after each compaction is the budget, so the mean cache is
# larger than B). `retention report` shows each as the iso-cache columns of its mean-accounting row.
set -euo pipefail
export ARMS="triattention-128-prefill alpha-128-prefill pyramidkv-128-prefill adakv-128-prefill \
merge-128-prefill newline-128-prefill loop-guard-128-prefill quant-int8-same-bytes-prefill"
exec bash "$(dirname "$0")/design_space.sh"
