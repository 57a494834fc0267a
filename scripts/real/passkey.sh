#!/usr/bin/env bash
# Pass-key retrieval on a real model: full vs streaming vs h2o at a KV budget well under the length, lengths
# LENGTHS, depths 0-100%, 5 keys per cell; asked in the model's chat template when it has one (the JSON records the
# prompt). Results and heatmaps in docs/results/$MODEL/passkey/.
# usage: scripts/real/passkey.sh smollm2 [LENGTHS] [BUDGET]   (gemma3-270m: 1024,4096,16384,32768)
set -euo pipefail
MODEL=${1:-smollm2}
LENGTHS=${2:-1024,2048,4096,8192}
BUDGET=${3:-512}
SG="${PYTHON:-.venv/bin/python} -m sparsegen"
OUT=docs/results/$MODEL/passkey
mkdir -p "$OUT"
for policy in full streaming h2o; do
  [ -f "$OUT/$policy.json" ] || $SG passkey --model "$MODEL" --policy "$policy" --budget "$BUDGET" \
    --lengths "$LENGTHS" --depths 0,0.25,0.5,0.75,1 --trials 5 --json "$OUT/$policy.json" --plot "$OUT/$policy.png"
done
