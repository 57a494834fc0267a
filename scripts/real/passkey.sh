#!/usr/bin/env bash
# Pass-key retrieval on a real model: full vs streaming vs h2o at a KV budget well under the length, lengths
# LENGTHS, DEPTHS (default 0-100% in quarters), TRIALS keys per cell (default 5); asked in the model's chat template
# when it has one (the JSON records the prompt). Results and heatmaps in docs/results/$MODEL/passkey/; TAG names a
# second grid (full$TAG.json, ...) beside the first; POLICIES picks some of full, streaming, h2o (to run them
# side by side).
# usage: scripts/real/passkey.sh smollm2 [LENGTHS] [BUDGET]
#        DEPTHS=0,0.5,1 scripts/real/passkey.sh gemma3-270m 1024,8192,32768 2048   (a 32K prompt: ~2 min of a core)
set -euo pipefail
MODEL=${1:-smollm2}
LENGTHS=${2:-1024,2048,4096,8192}
BUDGET=${3:-512}
SG="${PYTHON:-.venv/bin/python} -m sparsegen"
OUT=docs/results/$MODEL/passkey
mkdir -p "$OUT"
for policy in ${POLICIES:-full streaming h2o}; do
  [ -f "$OUT/$policy${TAG:-}.json" ] || $SG passkey --model "$MODEL" --policy "$policy" --budget "$BUDGET" \
    --lengths "$LENGTHS" --depths "${DEPTHS:-0,0.25,0.5,0.75,1}" --trials "${TRIALS:-5}" \
    --json "$OUT/$policy${TAG:-}.json" --plot "$OUT/$policy${TAG:-}.png"
done
