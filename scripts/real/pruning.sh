#!/usr/bin/env bash
# Weight pruning on a real model, the papers' protocol at this machine's scale: 128 calibration sequences of
# SEQLEN tokens from books/train; dense / magnitude / Wanda / SparseGPT at 50%, 4:8 and 2:4, structured 25% and
# 50% of MLP neurons; perplexity on wiki.test.raw and books/test (WINDOWS windows of 1,024 tokens each); pruning time
# and achieved sparsity (sparsity.json). Results in docs/results/$MODEL/pruning/; finished files are skipped;
# checkpoints in runs/$MODEL/pruned/. METHODS, AMOUNTS (0.5 4:8 2:4) and STRUCTURED=0 pick a subset.
# usage: scripts/real/pruning.sh smollm2
set -euo pipefail
MODEL=${1:-smollm2}
SG="${PYTHON:-.venv/bin/python} -m sparsegen"
DATA=${SPARSEGEN_DATA:-../shared/data}
OUT=docs/results/$MODEL/pruning
CKPT=runs/$MODEL/pruned
SEQLEN=${SEQLEN:-512}
WINDOWS=${WINDOWS:-64}
mkdir -p "$OUT" "$CKPT"
once() { [ -f "$1" ] || "${@:2}"; }
evaluate() {  # MODEL TAG
  once "$OUT/$2_wiki.json" $SG ppl --model "$1" --windows --ctx 1024 --max-windows "$WINDOWS" \
    --text "$DATA/wikitext-2-raw/wiki.test.raw" --json "$OUT/$2_wiki.json"
  once "$OUT/$2_books.json" $SG ppl --model "$1" --windows --ctx 1024 --max-windows "$WINDOWS" \
    --text "$DATA/books/test" --json "$OUT/$2_books.json"
}
prune() {  # TAG [prune options]
  if [ ! -f "$OUT/$1_sparsity.json" ]; then  # (scripts/real/prompt.sh may have pruned it already)
    [ -f "$CKPT/$1/sparsity.json" ] || $SG prune --model "$MODEL" --calib "$DATA/books/train" --nsamples 128 \
      --seqlen "$SEQLEN" --out "$CKPT/$1" --force "${@:2}"
    cp "$CKPT/$1/sparsity.json" "$OUT/$1_sparsity.json"
  fi
  evaluate "$CKPT/$1" "$1"
}
evaluate "$MODEL" dense
for method in ${METHODS:-magnitude wanda sparsegpt}; do
  for amount in ${AMOUNTS:-0.5 4:8 2:4}; do
    case $amount in
      *:*) prune "${method}_${amount/:/of}" --method "$method" --pattern "$amount" ;;
      *) prune "${method}_$amount" --method "$method" --sparsity "$amount" ;;
    esac
  done
done
[ "${STRUCTURED:-1}" = 1 ] || exit 0
for method in magnitude wanda; do
  prune "${method}_neurons0.25" --method "$method" --structured neurons=0.25
  prune "${method}_neurons0.5" --method "$method" --structured neurons=0.5
done
