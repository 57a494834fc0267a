#!/usr/bin/env bash
# Contextual sparsity on the bundled reference models: fit Deja Vu predictors and TEAL thresholds, then
# perplexity (books/test, first 200 windows of 512 tokens) and batch-1 decode speed. Results in $OUT.
set -euo pipefail
OUT=${OUT:-runs/contextual}
SG="${PYTHON:-.venv/bin/python} -m sparsegen"
WINDOWS=${WINDOWS:-200}
mkdir -p "$OUT"
fit() { [ -f "$OUT/$1/contextual.json" ] || $SG contextual fit --out "$OUT/$1" --force "${@:2}" | tee "$OUT/$1.fit.txt"; }
ppl() { [ -f "$OUT/ppl-$1.json" ] || $SG ppl --windows --max-windows "$WINDOWS" --json "$OUT/ppl-$1.json" "${@:2}"; }

fit relu-dv-recall95 --model reference-relu --method dejavu --recall 0.95
fit relu-dv90 --model reference-relu --method dejavu --sparsity 0.9
fit relu-dv-recall95-heads25 --model reference-relu --method dejavu --recall 0.95 --heads 0.25
fit relu-teal50 --model reference-relu --method teal --sparsity 0.5
fit swiglu-teal50 --model reference --method teal --sparsity 0.5
fit swiglu-teal50-mlp --model reference --method teal --sparsity 0.5 --targets mlp
fit swiglu-dv50 --model reference --method dejavu --sparsity 0.5

ppl relu-dense --model reference-relu
ppl swiglu-dense --model reference
for plan in relu-dv-recall95 relu-dv90 relu-dv-recall95-heads25 relu-teal50; do
  ppl "$plan" --model reference-relu --contextual "$OUT/$plan"
done
for plan in swiglu-teal50 swiglu-teal50-mlp swiglu-dv50; do
  ppl "$plan" --model reference --contextual "$OUT/$plan"
done
BENCH="--policies full --contexts 512 --batch 1 --prefill synthetic --new-tokens 64 --repeats 3"
$SG bench --model reference-relu $BENCH --json "$OUT/bench-relu.json" \
  --contextual "none,$OUT/relu-dv-recall95,$OUT/relu-dv90,$OUT/relu-teal50"
$SG bench --model reference $BENCH --json "$OUT/bench-swiglu.json" \
  --contextual "none,$OUT/swiglu-teal50,$OUT/swiglu-teal50-mlp"
