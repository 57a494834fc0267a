"""The reference model's scripted-chat run (examples/experiments/reference/serve.toml):
``chat_turns.py lines FILE N`` prints FILE's first N non-empty lines (one user turn each);
``chat_turns.py report DIR [FILES]`` plots ``DIR/chat-{streaming,full}.json`` (KV and RSS per turn) and prints a
summary (FILES: the chat results it reads, named so that the experiment runs it after them)."""

import json
import sys
from pathlib import Path

from sparsegen.eval.plots import plot_turns

if sys.argv[1] == "lines":
    lines = [line for line in Path(sys.argv[2]).read_text().splitlines() if line.strip()]
    print("\n".join(lines[: int(sys.argv[3])]))
else:
    out = Path(sys.argv[2])
    runs = {p: json.loads((out / f"chat-{p}.json").read_text())["turns"] for p in ("streaming", "full")}
    plot_turns({"streaming, budget 256": runs["streaming"], "full": runs["full"]}, out / "chat-1000.png",
               title="reference: scripted chat, one line of Tiny Shakespeare per user turn")
    for name, turns in runs.items():
        first, last = turns[0], turns[-1]
        print(f"{name}: {last['tokens_seen']:,} tokens seen; KV held {first['kv_bytes'] / 2**20:.2f} -> "
              f"{last['kv_bytes'] / 2**20:.2f} MiB; RSS {first['rss_bytes'] / 2**20:.0f} -> "
              f"{last['rss_bytes'] / 2**20:.0f} MiB; turn seconds first 10 "
              f"{sum(t['seconds'] for t in turns[:10]) / 10:.3f}, last 10 "
              f"{sum(t['seconds'] for t in turns[-10:]) / 10:.3f}")
