#!/usr/bin/env bash
# StreamingLLM on the reference model (books/test, 4 books streamed side by side). Writes docs/results/.
set -euo pipefail
S=.venv/bin/sparsegen
OUT=docs/results
TEXT=../shared/data/books/test
# sink sweep at a 256-token budget (0 sinks = plain window attention), 200k tokens per policy
for sinks in 0 1 2 4 8; do
  $S ppl --stream --text $TEXT --policy streaming --sinks $sinks --budget 256 --max-tokens 200000 \
    --segment 5000 --json $OUT/stream_sinks${sinks}_b256.json
done
# the dense cache past the trained length, and sliding window with re-computation (short runs: O(n^2) / O(nW))
$S ppl --stream --text $TEXT --policy full --policy streaming --sinks 4 --budget 256 --max-tokens 16000 \
  --segment 500 --json $OUT/stream_full_16k.json --plot $OUT/stream_full_16k.png
$S ppl --stream --text $TEXT --policy recompute --policy window --policy streaming --sinks 4 --budget 256 \
  --max-tokens 8000 --segment 500 --json $OUT/stream_recompute_8k.json --plot $OUT/stream_recompute_8k.png
# a million tokens through 4 sinks + 252 recent: the four test books cut into 8 streams of 125k tokens
$S ppl --stream --text $TEXT --streams 8 --policy streaming --sinks 4 --budget 256 --max-tokens 1000000 \
  --segment 10000 --every 2048 --json $OUT/stream_1m_streaming.json --plot $OUT/stream_1m_streaming.png
