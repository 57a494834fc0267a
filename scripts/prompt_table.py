"""The reference model's Compress-then-prompt tables (docs/prompt.md) from the JSON that
examples/experiments/reference/prompt.toml writes (default docs/results/prompt)."""

import json
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/prompt")


def ppl(name: str, text: str) -> float | None:
    path = root / f"ppl-{name}-{text}.json"
    return json.loads(path.read_text())["ppl"] if path.exists() else None


ROWS = [
    ("dense (reference, float16 on disk)", "dense", None),
    ("dense + soft prompt (next-token, vocabulary init)", "dense-soft-lm", None),
    ("dense + soft prompt (next-token, text init)", "dense-soft-text", None),
    ("Wanda 50% + int4 RTN (the compressed model)", "compressed", "compressed"),
    ("compressed + hard prompt", "compressed-hard", "compressed"),
    ("compressed + soft prompt (next-token, vocabulary init)", "compressed-soft-lm", "compressed"),
    ("compressed + soft prompt (next-token, text init)", "compressed-soft-text", "compressed"),
    ("compressed + soft prompt (KL to dense)", "compressed-soft-kl", "compressed"),
    ("SparseGPT 50% + int8 GPTQ (transfer target)", "other", "other"),
    ("  + the Wanda/int4 prompt (next-token, vocabulary init)", "other-soft-lm", "other"),
    ("  + the Wanda/int4 prompt (next-token, text init)", "other-soft-text", "other"),
    ("  + the Wanda/int4 prompt (KL to dense)", "other-soft-kl", "other"),
]


def cell(name: str, base: str | None, text: str) -> str:
    value, dense, start = ppl(name, text), ppl("dense", text), ppl(base, text) if base else None
    if value is None:
        return "—"
    if start is None or name == base:
        return f"{value:,.2f}"
    return f"{value:,.2f} ({(start - value) / (start - dense):+.0%})"


print("| model | `books/test` PPL (recovery) | `wiki.test.raw` PPL (recovery) |\n|---|---|---|")
for label, name, base in ROWS:
    print(f"| {label} | {cell(name, base, 'books')} | {cell(name, base, 'wiki')} |")
streams = sorted(root.glob("stream-*.json"))
if streams:
    print("\n| cache (budget 128), compressed model | stream PPL | KV peak |\n|---|---|---|")
    for path in streams:
        data = json.loads(path.read_text())
        print(f"| {path.stem.removeprefix('stream-')} | {data['ppl']:.2f} | {data['kv_tokens_peak']} |")
