#!/usr/bin/env bash
# Issue 35 on SmolLM2 (serve --policy streaming --budget 512): the acceptance run (hang-ups, content parts, model
# lookup), 1,000 distinct one-turn sessions 6 at a time (RSS per 8), and a 10-minute soak of 32 concurrent sessions
# with 4 chaos clients and the hostile one. Each step is skipped when its result exists (resume by re-running).
# BASELINE=COMMIT also runs 200 sessions against that commit's server (the before of a before/after).
set -euo pipefail
OUT=${OUT:-docs/results/smollm2/serve}
PY=${PYTHON:-.venv/bin/python}
PORT=${PORT:-8821}
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"

serve() {  # serve [extra flags...]: start a server in the background, wait until healthy
  $PY -m sparsegen serve --model smollm2 --policy streaming --budget 512 --port "$PORT" --log-level info "$@" \
    > "$OUT/serve-$step.log" 2>&1 &
  server=$!
  for _ in $(seq 180); do curl -sf "$URL/health" > /dev/null && return; sleep 1; done
  echo "the server did not start" >&2; exit 1
}
stop() { kill -INT "$server"; wait "$server" || true; }
trap 'kill $server 2>/dev/null || true' EXIT

step=acceptance
if [ ! -f "$OUT/acceptance.json" ]; then
  serve --max-batch 8
  $PY scripts/real/serve_acceptance.py "$URL" smollm2 > "$OUT/acceptance.json.tmp"
  mv "$OUT/acceptance.json.tmp" "$OUT/acceptance.json"
  stop
fi
step=sessions
if [ ! -f "$OUT/sessions-1000.json" ]; then
  serve
  $PY -m sparsegen bench-serve --url "$URL" --sessions 1000 --concurrency 6 --turns 1 --max-tokens 4 --sample-every 8 \
    --json "$OUT/sessions-1000.json" --plot "$OUT/sessions-1000.png" | tee "$OUT/sessions-1000.txt"
  stop
fi
if [ -n "${BASELINE:-}" ] && [ ! -f "$OUT/sessions-200-before.json" ]; then
  step=before
  git worktree add -f /tmp/sparsegen-baseline "$BASELINE"
  (cd /tmp/sparsegen-baseline && PYTHONPATH=/tmp/sparsegen-baseline "$OLDPWD/$PY" -m sparsegen serve --model smollm2 \
    --policy streaming --budget 512 --port "$PORT" > "$OLDPWD/$OUT/serve-before.log" 2>&1) &
  server=$!
  for _ in $(seq 180); do curl -sf "$URL/health" > /dev/null && break; sleep 1; done
  $PY -m sparsegen bench-serve --url "$URL" --sessions 200 --concurrency 6 --turns 1 --max-tokens 4 --sample-every 8 \
    --json "$OUT/sessions-200-before.json" | tee "$OUT/sessions-200-before.txt"
  pkill -f "port $PORT" || true
  git worktree remove --force /tmp/sparsegen-baseline
fi
step=soak
if [ ! -f "$OUT/soak.json" ]; then
  serve
  $PY -m sparsegen bench-serve --url "$URL" --sessions 32 --duration 600 --turns 3 --max-tokens 16 --chaos 4 --hostile \
    --sample-every 32 --json "$OUT/soak.json" --plot "$OUT/soak.png" | tee "$OUT/soak.txt"
  stop
fi
