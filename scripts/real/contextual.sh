#!/usr/bin/env bash
# Contextual sparsity on a real model: TEAL thresholds at 25/40/50/65% (every decoder linear, and MLP only) and
# Deja Vu predictors (MLP neurons at 50% and 75%, and 25% of heads; recall per layer in the fit report), fit on books/train; perplexity on books/test
# (WINDOWS windows of 1,024 tokens) and batch-1 decode ms/token dense vs sparse. Results in
# docs/results/$MODEL/contextual/; plans in runs/$MODEL/contextual/. TEAL picks levels, DEJAVU=0 skips Deja Vu.
# usage: scripts/real/contextual.sh smollm2
set -euo pipefail
MODEL=${1:-smollm2}
SG="${PYTHON:-.venv/bin/python} -m sparsegen"
DATA=${SPARSEGEN_DATA:-../shared/data}
OUT=docs/results/$MODEL/contextual
PLANS=runs/$MODEL/contextual
WINDOWS=${WINDOWS:-64}
mkdir -p "$OUT" "$PLANS"
once() { [ -f "$1" ] || "${@:2}"; }
fit() {  # TAG [fit options]: the plan is git-ignored, its report is kept; a fresh checkout refits what bench needs
  if [ ! -f "$PLANS/$1/contextual.json" ]; then
    $SG contextual fit --model "$MODEL" --calib "$DATA/books/train" --out "$PLANS/$1" --force "${@:2}"
    cp "$PLANS/$1/contextual.json" "$OUT/$1.fit.json"
  fi
}
ppl() {  # TAG [ppl options]
  once "$OUT/ppl-$1.json" $SG ppl --model "$MODEL" --windows --ctx 1024 --max-windows "$WINDOWS" \
    --text "$DATA/books/test" --json "$OUT/ppl-$1.json" "${@:2}"
}
ppl dense
for pct in ${TEAL:-25 40 50 65}; do
  fit "teal$pct" --method teal --sparsity "0.$pct"
  fit "teal$pct-mlp" --method teal --sparsity "0.$pct" --targets mlp
  ppl "teal$pct" --contextual "$PLANS/teal$pct"
  ppl "teal$pct-mlp" --contextual "$PLANS/teal$pct-mlp"
done
# Deja Vu keeps every layer's inputs and MLP activations of the calibration text in memory for training (fp32:
# layers x tokens x (hidden + intermediate) x 4 bytes, 4.2 GB for smollm2 at 16K tokens), hence 32 windows
[ "${DEJAVU:-1}" = 1 ] || exit 0
DV="--method dejavu --nsamples 32"
fit dejavu50 $DV --sparsity 0.5
fit dejavu75 $DV --sparsity 0.75
fit dejavu50-heads25 $DV --sparsity 0.5 --heads 0.25
for plan in dejavu50 dejavu75 dejavu50-heads25; do ppl "$plan" --contextual "$PLANS/$plan"; done
once "$OUT/bench.json" $SG bench --model "$MODEL" --policies full --contexts 512 --batch 1 --prefill synthetic \
  --new-tokens 64 --repeats 3 --json "$OUT/bench.json" \
  --contextual "none,$PLANS/teal50,$PLANS/teal50-mlp,$PLANS/dejavu50,$PLANS/dejavu75"
