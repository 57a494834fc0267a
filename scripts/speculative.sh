#!/usr/bin/env bash
# Self-speculative decoding on a real model: tokens/s of the full cache vs drafting from a small cache, lossless.
# Usage: scripts/speculative.sh [MODEL]   (default smollm2; ~30 min on 2 CPU cores)
# Environment: CONTEXTS (default 2048,8192), BATCHES (default "1 8"), DRAFTS, NEW (timed tokens, default 32).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2}
out=docs/results/speculative
mkdir -p "$out"
drafts=${DRAFTS:-speculative:streaming:512,speculative:h2o:512}
for batch in ${BATCHES:-1 8}; do
  json="$out/$model-bench-b$batch.json"
  [ -s "$json" ] && { echo "have $json"; continue; }
  .venv/bin/sparsegen bench --model "$model" --policies "full,$drafts" --contexts "${CONTEXTS:-2048,8192}" \
    --batch "$batch" --new-tokens "${NEW:-32}" --warmup 2 --text ../shared/data/books/test --json "$json"
done
