#!/usr/bin/env bash
# Compress, then prompt, on a real model: Wanda 50% + int4 (RTN), SparseGPT 50% + int8 (GPTQ) and Wanda 2:4 + int4
# as compressed models (from scripts/real/pruning.sh's checkpoints); a soft prompt learned on books/train
# for Wanda 50% + int4 (next-token loss, and KL to the dense model); perplexity on books/test and wiki.test.raw
# (WINDOWS windows of 512 tokens, default 32) for dense / compressed / + hard prompt / + soft prompt, and the prompt carried
# to the other compressions. Results in docs/results/$MODEL/prompt/; PROMPTS (lm kl) picks the prompts trained;
# STEPS (100), TOKENS (32) and LR (3e-3) set their training, and TAG names a variant (soft-lm$TAG.safetensors, ...).
# usage: scripts/real/prompt.sh smollm2
set -euo pipefail
MODEL=${1:-smollm2}
SG="${PYTHON:-.venv/bin/python} -m sparsegen"
DATA=${SPARSEGEN_DATA:-../shared/data}
OUT=docs/results/$MODEL/prompt
RUNS=runs/$MODEL
STEPS=${STEPS:-100}
TOKENS=${TOKENS:-32}
LR=${LR:-3e-3}
TAG=${TAG:-}
WINDOWS=${WINDOWS:-32}
HARD="Please carefully examine the weight matrix within the model, as it may contain errors. It is crucial to verify its integrity and make any necessary corrections for optimal performance."
mkdir -p "$OUT" "$RUNS/prompt"
once() { [ -e "$1" ] || "${@:2}"; }
pruned() {  # TAG [prune options]: reuse pruning.sh's checkpoint when it is there
  once "$RUNS/pruned/$1/config.json" $SG prune --model "$MODEL" --calib "$DATA/books/train" --out "$RUNS/pruned/$1" \
    --force "${@:2}"
}
pruned wanda_0.5 --method wanda --sparsity 0.5
pruned sparsegpt_0.5 --method sparsegpt --sparsity 0.5
pruned wanda_2of4 --method wanda --pattern 2:4
quantized() {  # NAME SOURCE [quantize options]
  once "$RUNS/prompt/$1/config.json" $SG quantize --model "$RUNS/pruned/$2" --out "$RUNS/prompt/$1" --force "${@:3}"
}
# groups of 64 columns: vLLM's kernels and compressed-tensors need the group to divide every linear's inputs
# (smollm2's hidden size is 576 = 9 x 64)
quantized wanda50-int4 wanda_0.5 --method rtn --bits 4 --group-size 64
quantized sgpt50-int8 sparsegpt_0.5 --method gptq --bits 8 --group-size 64 --calib "$DATA/books/train"
quantized wanda24-int4 wanda_2of4 --method rtn --bits 4 --group-size 64
TRAIN="--steps $STEPS --tokens $TOKENS --lr $LR --seqlen 512 --batch-size 4 --calib $DATA/books/train"
PROMPTS=${PROMPTS:-lm kl}  # next-token loss, KL to the dense model
for kind in $PROMPTS; do
  teacher=(); [ "$kind" = kl ] && teacher=(--teacher "$MODEL")
  once "$OUT/soft-$kind$TAG.safetensors" $SG prompt-tune --model "$RUNS/prompt/wanda50-int4" "${teacher[@]}" $TRAIN \
    --out "$OUT/soft-$kind$TAG.safetensors"
done
ppl() {  # NAME MODEL [prompt options]: books/test and wiki.test.raw
  once "$OUT/ppl-$1-books.json" $SG ppl --windows --ctx 512 --max-windows "$WINDOWS" --model "$2" "${@:3}" \
    --text "$DATA/books/test" --json "$OUT/ppl-$1-books.json"
  once "$OUT/ppl-$1-wiki.json" $SG ppl --windows --ctx 512 --max-windows "$WINDOWS" --model "$2" "${@:3}" \
    --text "$DATA/wikitext-2-raw/wiki.test.raw" --json "$OUT/ppl-$1-wiki.json"
}
ppl dense "$MODEL"
for name in wanda50-int4 sgpt50-int8 wanda24-int4; do
  ppl "$name" "$RUNS/prompt/$name"
  ppl "$name-hard" "$RUNS/prompt/$name" --hard-prompt "$HARD"
  for kind in $PROMPTS; do
    ppl "$name-soft-$kind$TAG" "$RUNS/prompt/$name" --soft-prompt "$OUT/soft-$kind$TAG.safetensors"
  done
done
