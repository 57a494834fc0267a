#!/usr/bin/env bash
# Every real-model result in order of the README's headline table, one job at a time (2 cores); each script skips
# what it already wrote, so rerunning after an interruption resumes.   usage: scripts/real/all.sh [MODEL...]
# A failing script is reported and the next one runs.
set -uo pipefail
failed=0
for model in "${@:-smollm2}"; do
  for part in streamingllm h2o pruning contextual prompt passkey; do
    echo "== $part $model ($(date +%T))"
    scripts/real/$part.sh "$model" || { echo "== FAILED: $part $model"; failed=1; }
  done
done
exit $failed
