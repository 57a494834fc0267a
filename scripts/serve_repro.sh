#!/usr/bin/env bash
# Serving on the bundled reference model: 64 concurrent sessions x 100 turns against `sparsegen serve` (streaming,
# budget 256), then a 1,000-turn scripted chat under streaming and its first 400 turns under full (KV memory and
# latency per turn).
set -euo pipefail
OUT=${OUT:-runs/serve}
PY=${PYTHON:-.venv/bin/python}
SG="$PY -m sparsegen"
PORT=${PORT:-8765}
SESSIONS=${SESSIONS:-64}
TURNS=${TURNS:-100}
CHAT_TURNS=${CHAT_TURNS:-1000}
FULL_TURNS=${FULL_TURNS:-400}
mkdir -p "$OUT"
if [ ! -f "$OUT/load.json" ]; then
  $SG serve --model reference --policy streaming --budget 256 --port "$PORT" --max-sessions "$SESSIONS" \
    --max-batch "$SESSIONS" --max-queue $((2 * SESSIONS)) --max-tokens-limit 64 > "$OUT/serve.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
  $SG bench-serve --url "http://127.0.0.1:$PORT" --sessions "$SESSIONS" --turns "$TURNS" --max-tokens 16 \
    --json "$OUT/load.json" --plot "$OUT/load.png" | tee "$OUT/load.txt"
  kill "$server"
  wait "$server" || true
fi
{ grep -v "^\s*$" ../shared/data/tinyshakespeare.txt || true; } | head -n "$CHAT_TURNS" > "$OUT/turns.txt" || true
head -n "$FULL_TURNS" "$OUT/turns.txt" > "$OUT/turns-full.txt"  # full grows with every turn: fewer of them
for policy in streaming full; do
  script="$OUT/turns.txt"
  [ "$policy" = full ] && script="$OUT/turns-full.txt"
  [ -f "$OUT/chat-$policy.json" ] || $SG chat --model reference --policy "$policy" --budget 256 --max-new-tokens 16 \
    --script "$script" --json "$OUT/chat-$policy.json" > "$OUT/chat-$policy.txt"
done
$PY - "$OUT" <<'PLOT'
import json, sys
from sparsegen.eval.plots import plot_turns
out = sys.argv[1]
runs = {p: json.load(open(f"{out}/chat-{p}.json"))["turns"] for p in ("streaming", "full")}
plot_turns({"streaming, budget 256": runs["streaming"], "full": runs["full"]}, f"{out}/chat-1000.png",
           title="reference: scripted chat, one line of Tiny Shakespeare per user turn")
for name, turns in runs.items():
    first, last = turns[0], turns[-1]
    print(f"{name}: {last['tokens_seen']:,} tokens seen; KV held {first['kv_bytes'] / 2**20:.2f} -> "
          f"{last['kv_bytes'] / 2**20:.2f} MiB; RSS {first['rss_bytes'] / 2**20:.0f} -> {last['rss_bytes'] / 2**20:.0f} MiB; "
          f"turn seconds first 10 {sum(t['seconds'] for t in turns[:10]) / 10:.3f}, last 10 "
          f"{sum(t['seconds'] for t in turns[-10:]) / 10:.3f}")
PLOT
