#!/usr/bin/env bash
# Decode speed of int4 weights (PyTorch's packed int4 CPU kernel, bfloat16) against the dense model in float32 and
# bfloat16: the reference model and a Llama-3.2-1B shape with random weights. Batch 1, synthetic 512-token context.
# Results in docs/results/quant/.   usage: scripts/quant_speed.sh
set -euo pipefail
SG="${PYTHON:-.venv/bin/python} -m sparsegen"
OUT=docs/results/quant
RUNS=runs/quant
mkdir -p "$OUT" "$RUNS"
BENCH="--policies full --contexts 512 --batch 1 --prefill synthetic --new-tokens 32 --warmup 4 --repeats 3"
[ -f "$RUNS/reference-int4/config.json" ] || $SG quantize --model reference --method rtn --bits 4 --group-size 128 \
  --out "$RUNS/reference-int4" --force
[ -f "$RUNS/llama-1b-int4/config.json" ] || $SG quantize --model random:llama-1b --method rtn --bits 4 \
  --group-size 128 --out "$RUNS/llama-1b-int4" --force
for model in reference:reference-int4 random:llama-1b:llama-1b-int4; do
  dense=${model%:*}; int4=$RUNS/${model##*:}; tag=${model##*:}
  $SG bench --model "$dense" --dtype float32 $BENCH --json "$OUT/$tag-dense-fp32.json"
  $SG bench --model "$dense" --dtype bfloat16 $BENCH --json "$OUT/$tag-dense-bf16.json"
  $SG bench --model "$int4" --dtype bfloat16 $BENCH --json "$OUT/$tag-bf16.json"
done
