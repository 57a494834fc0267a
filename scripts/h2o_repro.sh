#!/usr/bin/env bash
# H2O on the reference model: 20% and 10% KV budgets inside the trained length. Writes docs/results/.
set -euo pipefail
S=.venv/bin/sparsegen
OUT=docs/results
TEXT=../shared/data/books/test
for pct in 20 10; do
  budget=$(( 512 * pct / 100 ))
  # perplexity: 64 streams of 512 tokens (<s> + 511), every token predicted with the policy's cache
  $S ppl --stream --text $TEXT --streams 64 --max-tokens 32704 --segment 64 --budget $budget \
    --policy full --policy h2o --policy window --policy streaming --sinks 4 \
    --json $OUT/h2o_ppl_${pct}pct.json --plot $OUT/h2o_ppl_${pct}pct.png
  # fidelity: 16 prompts of 400 tokens from Dracula, 64 greedy tokens
  $S fidelity --policy h2o --policy window --policy streaming --sinks 4 --budget $(python3 -c "print($pct/100)") \
    --prompts 16 --prompt-tokens 400 --new-tokens 64 --json $OUT/h2o_fidelity_${pct}pct.json
done
