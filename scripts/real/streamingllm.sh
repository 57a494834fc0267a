#!/usr/bin/env bash
# StreamingLLM on a real model: streaming perplexity on books/test past the trained length (one stream per book),
# every policy at budgets 256 and 1024, a sink sweep, streaming vs recompute latency, and (with MILLION=1) a
# 1,000,000-token run at flat memory. Results in docs/results/$MODEL/streaming/; finished files are skipped, so an
# interrupted run resumes. BUDGETS, POLICIES and SINKS pick a subset (SINKS= runs no sweep), RECOMPUTE=0 skips the
# re-computation runs.   usage: scripts/real/streamingllm.sh smollm2 [tokens per stream]
set -euo pipefail
MODEL=${1:-smollm2}
PER_STREAM=${2:-20000}
STREAMS=${STREAMS:-2}
SG="${PYTHON:-.venv/bin/python} -m sparsegen"
OUT=docs/results/$MODEL/streaming
TEXT=${SPARSEGEN_DATA:-../shared/data}/books/test
mkdir -p "$OUT"
once() { [ -f "$1" ] || "${@:2}"; }
run() {  # NAME [ppl options]: STREAMS books side by side, PER_STREAM tokens each
  once "$OUT/$1.json" $SG ppl --model "$MODEL" --stream --text "$TEXT" --streams "$STREAMS" \
    --max-tokens $((STREAMS * PER_STREAM)) --segment 1000 --every 1024 --json "$OUT/$1.json" "${@:2}"
}
run full --policy full
for budget in ${BUDGETS:-256 1024}; do
  for policy in ${POLICIES:-window streaming h2o streaming-h2o}; do
    run "$policy-$budget" --policy "$policy" --budget "$budget"
  done
  for sinks in ${SINKS-1 2 8}; do  # 0 sinks is window, 4 is streaming
    run "sinks$sinks-$budget" --policy streaming --sinks "$sinks" --budget "$budget"
  done
done
if [ "${RECOMPUTE:-1}" = 1 ]; then
  # sliding window with re-computation: every token re-encodes its last 256 (short: it costs 256x per token), and
  # window and streaming over the same 1,500 tokens to compare with
  once "$OUT/recompute-256.json" $SG ppl --model "$MODEL" --stream --text "$TEXT" --streams 1 --max-tokens 1500 \
    --segment 250 --policy recompute --budget 256 --json "$OUT/recompute-256.json"
  for policy in window streaming; do
    once "$OUT/$policy-256-short.json" $SG ppl --model "$MODEL" --stream --text "$TEXT" --streams 1 --max-tokens 1500 \
      --segment 250 --policy "$policy" --budget 256 --json "$OUT/$policy-256-short.json"
  done
  # per-token decode latency at the same window: streaming (cache) vs recompute (re-encode the window every token),
  # at windows of 256 and 1,024
  once "$OUT/latency-recompute.json" $SG bench --model "$MODEL" --policies streaming,recompute --budget 256 \
    --contexts 1024 --new-tokens 64 --recompute-tokens 16 --json "$OUT/latency-recompute.json"
  once "$OUT/latency-recompute-1024.json" $SG bench --model "$MODEL" --policies streaming,recompute --budget 1024 \
    --contexts 2048 --new-tokens 64 --recompute-tokens 16 --json "$OUT/latency-recompute-1024.json"
fi
if [ "${MILLION:-0}" = 1 ]; then  # the four books as 8 streams of 125K tokens through 4 sinks + 252 recent
  once "$OUT/million.json" $SG ppl --model "$MODEL" --stream --text "$TEXT" --streams 8 --policy streaming --sinks 4 \
    --budget 256 --max-tokens 1000000 --segment 10000 --every 4096 --json "$OUT/million.json" \
    --plot "$OUT/million.png"
fi
