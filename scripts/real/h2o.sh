#!/usr/bin/env bash
# H2O on a real model at 50%, 20% and 10% of the sequence as KV budget: streaming perplexity (8 streams of
# LENGTH tokens from books/test, every token predicted with the policy's cache) and fidelity of greedy
# continuations against the full cache (ROUGE-L, tokens to first divergence, KL). Results in
# docs/results/$MODEL/h2o/; finished files are skipped; PCTS picks budgets, POLICIES the policies whose perplexity
# is measured (default the four the fidelity runs compare; any policy name works: the policy-library comparison).
# usage: scripts/real/h2o.sh smollm2 [LENGTH]
set -euo pipefail
MODEL=${1:-smollm2}
LENGTH=${2:-2048}
SG="${PYTHON:-.venv/bin/python} -m sparsegen"
OUT=docs/results/$MODEL/h2o
DATA=${SPARSEGEN_DATA:-../shared/data}
mkdir -p "$OUT"
once() { [ -f "$1" ] || "${@:2}"; }
ppl() {  # NAME [ppl options]
  once "$OUT/ppl-$1.json" $SG ppl --model "$MODEL" --stream --text "$DATA/books/test" --streams 8 \
    --max-tokens $((8 * LENGTH)) --segment 128 --json "$OUT/ppl-$1.json" "${@:2}"
}
ppl full --policy full
for pct in ${PCTS:-50 20 10}; do
  budget=$((LENGTH * pct / 100))
  for policy in ${POLICIES:-h2o streaming-h2o window streaming}; do
    ppl "$policy-${pct}pct" --policy "$policy" --budget "$budget"
  done
  once "$OUT/fidelity-${pct}pct.json" $SG fidelity --model "$MODEL" --text "$DATA/books/test/dracula.txt" \
    --policy h2o --policy streaming-h2o --policy window --policy streaming --budget "0.$pct" --prompts 8 \
    --prompt-tokens $((LENGTH / 2)) --new-tokens 64 --json "$OUT/fidelity-${pct}pct.json"
done
