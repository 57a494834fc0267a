#!/usr/bin/env bash
# Contextual sparsity speed on 1B-class shapes (random weights; weights far larger than the CPU caches):
# Deja Vu at 90% MLP sparsity on OPT-1.3B (a ReLU model) and Llama-3.2-1B, TEAL at 50% on Llama-3.2-1B.
# Plans are fit on random token ids (speed depends on how many units run, not on which).
set -euo pipefail
OUT=${OUT:-runs/contextual-1b}
SG="${PYTHON:-.venv/bin/python} -m sparsegen"
mkdir -p "$OUT"
fit() { [ -f "$OUT/$1/contextual.json" ] || $SG contextual fit --out "$OUT/$1" --force --nsamples 4 --seqlen 128 "${@:2}"; }
fit opt-dv90 --model random:opt-1.3b --method dejavu --sparsity 0.9 --epochs 2
fit llama-dv90 --model random:llama-1b --method dejavu --sparsity 0.9 --epochs 2
fit llama-teal50 --model random:llama-1b --method teal --sparsity 0.5
fit llama-teal50-mlp --model random:llama-1b --method teal --sparsity 0.5 --targets mlp
BENCH="--policies full --contexts 512 --batch 1 --prefill synthetic --new-tokens 32 --warmup 3 --repeats 2"
$SG bench --model random:opt-1.3b $BENCH --json "$OUT/bench-opt.json" --contextual "none,$OUT/opt-dv90"
$SG bench --model random:llama-1b $BENCH --json "$OUT/bench-llama.json" \
  --contextual "none,$OUT/llama-dv90,$OUT/llama-teal50,$OUT/llama-teal50-mlp"
