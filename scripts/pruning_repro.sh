#!/bin/bash
# Dense vs magnitude / Wanda / SparseGPT at 50%, 4:8 and 2:4 on the reference model: perplexity on
# wiki.test.raw and books/test (512-token windows; first 200 windows of each, about 102K tokens), pruning time.
# Writes docs/results/pruning/*.json; scripts/results_table.py prints the table.
set -euo pipefail
S=${SPARSEGEN:-.venv/bin/sparsegen}
DATA=${SPARSEGEN_DATA:-../shared/data}
OUT=docs/results/pruning
mkdir -p "$OUT" runs/pruned
eval_model() {  # model name
  $S ppl --model "$1" --windows --text "$DATA/wikitext-2-raw/wiki.test.raw" --max-windows 200 --json "$OUT/$2_wiki.json"
  $S ppl --model "$1" --windows --text "$DATA/books/test" --max-windows 200 --json "$OUT/$2_books.json"
}
eval_model reference dense
for method in magnitude wanda sparsegpt; do
  for amount in "--sparsity 0.5" "--pattern 4:8" "--pattern 2:4"; do
    tag="${method}_$(echo "$amount" | sed 's/--sparsity //; s/--pattern //; s/:/of/')"
    $S prune --model reference --method "$method" $amount --calib "$DATA/books/train" --nsamples 128 \
      --out "runs/pruned/$tag" --force
    cp "runs/pruned/$tag/sparsity.json" "$OUT/${tag}_sparsity.json"
    eval_model "runs/pruned/$tag" "$tag"
  done
done
for method in magnitude wanda; do
  for amount in neurons=0.25 neurons=0.5; do
    tag="${method}_${amount/=/}"
    $S prune --model reference --method "$method" --structured "$amount" --calib "$DATA/books/train" \
      --nsamples 128 --out "runs/pruned/$tag" --force
    cp "runs/pruned/$tag/sparsity.json" "$OUT/${tag}_sparsity.json"
    eval_model "runs/pruned/$tag" "$tag"
  done
done
tag=wanda_neurons0.25_heads0.5
$S prune --model reference --method wanda --structured neurons=0.25,heads=0.5 --calib "$DATA/books/train" \
  --nsamples 128 --out "runs/pruned/$tag" --force
cp "runs/pruned/$tag/sparsity.json" "$OUT/${tag}_sparsity.json"
eval_model "runs/pruned/$tag" "$tag"
