#!/usr/bin/env bash
# Composition on a real model: the sparsities stacked one at a time. Each row adds one to the row before:
#   full cache -> streaming (4 sinks, BUDGET tokens) -> Wanda 50% -> int4 weights (RTN, groups of 64) -> a 64-token
#   soft prompt (scripts/real/prompt.sh's best: 300 steps on Wanda 50% + int4) -> 4-bit KV;
# and a branch: streaming + Wanda 50% + TEAL 50% (contextual kernels gather float weights, so TEAL runs on the float
# pruned model, not the int4 one). Per row: streaming PPL over STREAMS streams of LENGTH books/test tokens, the KV
# held, the weight bytes, and batch-1 decode ms/token after a synthetic LENGTH-token prefill.
# Results in docs/results/$MODEL/composition/; finished files are skipped.   usage: scripts/real/composition.sh smollm2
set -euo pipefail
MODEL=${1:-smollm2}
SG="${PYTHON:-.venv/bin/python} -m sparsegen"
DATA=${SPARSEGEN_DATA:-../shared/data}
OUT=docs/results/$MODEL/composition
RUNS=runs/$MODEL
BUDGET=${BUDGET:-1024}
LENGTH=${LENGTH:-8192}
STREAMS=${STREAMS:-4}
SOFT=docs/results/$MODEL/prompt/soft-lm-t64-s300.safetensors
mkdir -p "$OUT" "$RUNS/pruned" "$RUNS/prompt" "$RUNS/composition"
once() { [ -e "$1" ] || "${@:2}"; }
once "$RUNS/pruned/wanda_0.5/config.json" $SG prune --model "$MODEL" --calib "$DATA/books/train" --nsamples 128 \
  --seqlen 512 --out "$RUNS/pruned/wanda_0.5" --force --method wanda --sparsity 0.5
once "$RUNS/prompt/wanda50-int4/config.json" $SG quantize --model "$RUNS/pruned/wanda_0.5" \
  --out "$RUNS/prompt/wanda50-int4" --force --method rtn --bits 4 --group-size 64
once "$SOFT" $SG prompt-tune --model "$RUNS/prompt/wanda50-int4" --steps 300 --tokens 64 --lr 3e-2 --seqlen 512 \
  --batch-size 4 --calib "$DATA/books/train" --out "$SOFT"
once "$RUNS/composition/teal50/contextual.json" $SG contextual fit --model "$RUNS/pruned/wanda_0.5" \
  --calib "$DATA/books/train" --method teal --sparsity 0.5 --out "$RUNS/composition/teal50" --force
row() {  # NAME MODEL POLICY DECODE_DTYPE [options for both ppl and bench]
  local name=$1 model=$2 policy=$3 dtype=$4 budget=()
  [ "$policy" = full ] || budget=(--budget "$BUDGET")
  once "$OUT/ppl-$name.json" $SG ppl --model "$model" --stream --text "$DATA/books/test" --streams "$STREAMS" \
    --max-tokens $((STREAMS * LENGTH)) --segment 1024 --policy "$policy" "${budget[@]}" "${@:5}" \
    --json "$OUT/ppl-$name.json"
  once "$OUT/bench-$name.json" $SG bench --model "$model" --policies "$policy" "${budget[@]}" --contexts "$LENGTH" \
    --batch 1 --prefill synthetic --new-tokens 32 --dtype "$dtype" "${@:5}" --json "$OUT/bench-$name.json"
}
# decode timed in float32, and from int4 on in bfloat16: the CPU int4 kernel takes bfloat16 activations (in float32
# the weights are dequantized every call); perplexity is computed in float32 throughout
row 1-full "$MODEL" full float32
row 2-streaming "$MODEL" streaming float32
row 3-wanda50 "$RUNS/pruned/wanda_0.5" streaming float32
row 4-int4 "$RUNS/prompt/wanda50-int4" streaming bfloat16
row 5-soft-prompt "$RUNS/prompt/wanda50-int4" streaming bfloat16 --soft-prompt "$SOFT"
row 6-kv4 "$RUNS/prompt/wanda50-int4" streaming bfloat16 --soft-prompt "$SOFT" --kv-bits 4
row 3b-teal50 "$RUNS/pruned/wanda_0.5" streaming float32 --contextual "$RUNS/composition/teal50"
