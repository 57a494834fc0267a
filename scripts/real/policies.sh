#!/usr/bin/env bash
# The policy library compared on one real model: every policy at PCTS (50 20 10) percent of LENGTH tokens as KV
# budget, with and without 4-bit KV (BITS="none 4"): streaming perplexity (h2o.sh's protocol and files), fidelity of
# 64 greedy tokens after 8 prompts of LENGTH/2 tokens against the full cache (ROUGE-L, KL), pass-key retrieval at
# LENGTH tokens and depths 0-100% (4 keys per depth, the model's chat template), and decode ms/token with the KV
# bytes held (a synthetic LENGTH-token prefill). Finished files are skipped: rerunning resumes. PARTS picks
# measurements (ppl fidelity passkey bench); POLICIES, PCTS and BITS pick a subset.
# Results in docs/results/$MODEL/policies/ (perplexity in docs/results/$MODEL/h2o/); `scripts/real/report.py` tables.
# usage: scripts/real/policies.sh smollm2 [LENGTH]
set -euo pipefail
MODEL=${1:-smollm2}
LENGTH=${2:-2048}
SG="${PYTHON:-.venv/bin/python} -m sparsegen"
DATA=${SPARSEGEN_DATA:-../shared/data}
OUT=docs/results/$MODEL/policies
PPL=docs/results/$MODEL/h2o
ALL="window streaming h2o streaming-h2o tova scissorhands snapkv pyramid adakv knorm keydiff lagkv random"
mkdir -p "$OUT" "$PPL"
once() { [ -f "$1" ] || "${@:2}"; }
wants() { [[ " ${PARTS:-ppl fidelity passkey bench} " == *" $1 "* ]]; }
if wants ppl; then
  once "$PPL/ppl-full.json" $SG ppl --model "$MODEL" --stream --text "$DATA/books/test" --streams 8 \
    --max-tokens $((8 * LENGTH)) --segment 128 --policy full --json "$PPL/ppl-full.json"
fi
for bits in ${BITS:-none 4}; do
  quant=() tag=""
  [ "$bits" = none ] || { quant=(--kv-bits "$bits"); tag="-kv$bits"; }
  for pct in ${PCTS:-50 20 10}; do
    budget=$((LENGTH * pct / 100))
    for policy in ${POLICIES:-$ALL}; do
      name="$policy-${pct}pct$tag"
      if wants ppl; then
        once "$PPL/ppl-$name.json" $SG ppl --model "$MODEL" --stream --text "$DATA/books/test" --streams 8 \
          --max-tokens $((8 * LENGTH)) --segment 128 --policy "$policy" --budget "$budget" "${quant[@]}" \
          --json "$PPL/ppl-$name.json"
      fi
      if wants fidelity; then
        once "$OUT/fidelity-$name.json" $SG fidelity --model "$MODEL" --text "$DATA/books/test/dracula.txt" \
          --policy "$policy" --budget "0.$pct" --prompts 8 --prompt-tokens $((LENGTH / 2)) --new-tokens 64 \
          "${quant[@]}" --json "$OUT/fidelity-$name.json"
      fi
      if wants passkey; then
        once "$OUT/passkey-$name.json" $SG passkey --model "$MODEL" --policy "$policy" --budget "$budget" \
          --lengths "$LENGTH" --depths 0,0.25,0.5,0.75,1 --trials 4 "${quant[@]}" --json "$OUT/passkey-$name.json"
      fi
    done
    if wants bench; then
      policies=$(echo ${POLICIES:-$ALL} | tr ' ' ',')
      once "$OUT/bench-${pct}pct$tag.json" $SG bench --model "$MODEL" --policies "full,$policies" \
        --budget "$budget" --contexts "$LENGTH" --batch 1 --prefill synthetic --new-tokens 32 "${quant[@]}" \
        --json "$OUT/bench-${pct}pct$tag.json"
    fi
  done
done
for bits in ${BITS:-none 4}; do  # the full cache quantized: what the bits alone cost
  [ "$bits" = none ] && continue
  if wants ppl; then
    once "$PPL/ppl-full-kv$bits.json" $SG ppl --model "$MODEL" --stream --text "$DATA/books/test" --streams 8 \
      --max-tokens $((8 * LENGTH)) --segment 128 --policy full --kv-bits "$bits" --json "$PPL/ppl-full-kv$bits.json"
  fi
  if wants fidelity; then
    once "$OUT/fidelity-full-kv$bits.json" $SG fidelity --model "$MODEL" --text "$DATA/books/test/dracula.txt" \
      --policy full --prompts 8 --prompt-tokens $((LENGTH / 2)) --new-tokens 64 --kv-bits "$bits" \
      --json "$OUT/fidelity-full-kv$bits.json"
  fi
  if wants passkey; then
    once "$OUT/passkey-full-kv$bits.json" $SG passkey --model "$MODEL" --policy full --lengths "$LENGTH" \
      --depths 0,0.25,0.5,0.75,1 --trials 4 --kv-bits "$bits" --json "$OUT/passkey-full-kv$bits.json"
  fi
done
if wants passkey; then
  once "$OUT/passkey-full.json" $SG passkey --model "$MODEL" --policy full --lengths "$LENGTH" \
    --depths 0,0.25,0.5,0.75,1 --trials 4 --json "$OUT/passkey-full.json"
fi
