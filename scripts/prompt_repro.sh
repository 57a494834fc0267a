#!/usr/bin/env bash
# Compress, then prompt, on the bundled reference model: Wanda 50% + int4 (RTN) as the compressed model, a 32-token
# soft prompt learned on books/train (next-token loss, and KL to the dense model), then perplexity on books/test and
# wiki.test.raw for dense / compressed / + hard prompt / + soft prompt, and the transfer of the prompt to SparseGPT
# 50% + int8 (GPTQ). Windows of 448 tokens for every row, so prompt + window fit the model's 512 positions.
set -euo pipefail
OUT=${OUT:-runs/prompt}
SG="${PYTHON:-.venv/bin/python} -m sparsegen"
STEPS=${STEPS:-300}
WINDOWS=${WINDOWS:-200}
HARD="Please carefully examine the weight matrix within the model, as it may contain errors. It is crucial to verify its integrity and make any necessary corrections for optimal performance."
mkdir -p "$OUT"
once() { [ -e "$1" ] || "${@:2}"; }
once "$OUT/wanda50/config.json" $SG prune --model reference --method wanda --sparsity 0.5 --out "$OUT/wanda50" --force
once "$OUT/wanda50-int4/config.json" $SG quantize --model "$OUT/wanda50" --method rtn --bits 4 --out "$OUT/wanda50-int4" --force
once "$OUT/sgpt50/config.json" $SG prune --model reference --method sparsegpt --sparsity 0.5 --out "$OUT/sgpt50" --force
once "$OUT/sgpt50-int8/config.json" $SG quantize --model "$OUT/sgpt50" --method gptq --bits 8 --out "$OUT/sgpt50-int8" --force
once "$OUT/soft-lm.safetensors" $SG prompt-tune --model "$OUT/wanda50-int4" --steps "$STEPS" --out "$OUT/soft-lm.safetensors"
once "$OUT/soft-text.safetensors" $SG prompt-tune --model "$OUT/wanda50-int4" --init text --steps "$STEPS" \
  --out "$OUT/soft-text.safetensors"
once "$OUT/soft-kl.safetensors" $SG prompt-tune --model "$OUT/wanda50-int4" --teacher reference --steps "$STEPS" \
  --out "$OUT/soft-kl.safetensors"
ppl() {  # NAME MODEL [prompt options]: books/test and wiki.test.raw
  once "$OUT/ppl-$1-books.json" $SG ppl --windows --ctx 448 --max-windows "$WINDOWS" --model "$2" "${@:3}" \
    --json "$OUT/ppl-$1-books.json"
  once "$OUT/ppl-$1-wiki.json" $SG ppl --windows --ctx 448 --max-windows "$WINDOWS" --model "$2" "${@:3}" \
    --text ../shared/data/wikitext-2-raw/wiki.test.raw --json "$OUT/ppl-$1-wiki.json"
}
ppl dense reference
ppl dense-soft-lm reference --soft-prompt "$OUT/soft-lm.safetensors"
ppl compressed "$OUT/wanda50-int4"
ppl compressed-hard "$OUT/wanda50-int4" --hard-prompt "$HARD"
ppl compressed-soft-lm "$OUT/wanda50-int4" --soft-prompt "$OUT/soft-lm.safetensors"
ppl compressed-soft-text "$OUT/wanda50-int4" --soft-prompt "$OUT/soft-text.safetensors"
ppl dense-soft-text reference --soft-prompt "$OUT/soft-text.safetensors"
ppl other-soft-text "$OUT/sgpt50-int8" --soft-prompt "$OUT/soft-text.safetensors"
ppl compressed-soft-kl "$OUT/wanda50-int4" --soft-prompt "$OUT/soft-kl.safetensors"
ppl other "$OUT/sgpt50-int8"
ppl other-soft-lm "$OUT/sgpt50-int8" --soft-prompt "$OUT/soft-lm.safetensors"
ppl other-soft-kl "$OUT/sgpt50-int8" --soft-prompt "$OUT/soft-kl.safetensors"
# The prompt as a learned sink: streaming perplexity of the compressed model under window/streaming caches of 128
# tokens, without and with the soft prompt (pinned: it takes 32 of the 128 slots).
stream() {  # NAME [options]
  once "$OUT/stream-$1.json" $SG ppl --stream --model "$OUT/wanda50-int4" --budget 128 --max-tokens 20000 "${@:2}" \
    --json "$OUT/stream-$1.json"
}
stream window --policy window
stream window-soft --policy window --soft-prompt "$OUT/soft-kl.safetensors"
stream streaming --policy streaming
stream streaming-soft --policy streaming --soft-prompt "$OUT/soft-kl.safetensors"
stream streaming-soft-lm --policy streaming --soft-prompt "$OUT/soft-lm.safetensors"
stream streaming-soft-text --policy streaming --soft-prompt "$OUT/soft-text.safetensors"
stream window-soft-text --policy window --soft-prompt "$OUT/soft-text.safetensors"
