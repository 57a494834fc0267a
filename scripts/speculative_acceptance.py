"""Acceptance of self-speculative drafts per draft policy and budget, on held-out books, checked lossless.

Usage: .venv/bin/python scripts/speculative_acceptance.py [MODEL] [--prompts 4] [--prompt-tokens 2048]
Writes docs/results/speculative/MODEL-acceptance.json and .png. Each prompt is a window of one books/test book; every
(policy, budget) drafts for the same batch, and its greedy output is compared with the full cache's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import sparsegen
from sparsegen.data import data_dir, tokenize_files
from sparsegen.engine.generate import generate_tokens
from sparsegen.engine.speculative import Speculation, speculative_tokens
from sparsegen.kv import make_policy

OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "speculative"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--policies", default="streaming,h2o,window")
    parser.add_argument("--budgets", default="256,512,1024")
    args = parser.parse_args()

    model, tokenizer = sparsegen.load(args.model)
    books = tokenize_files(data_dir() / "books" / "test", tokenizer)
    ids = torch.from_numpy(np.stack([book[10_000:10_000 + args.prompt_tokens].astype(np.int64)
                                     for book in books[:args.prompts]]))
    mask = torch.ones_like(ids)
    t0 = time.perf_counter()
    expected, _, _, _, full_decode = generate_tokens(model, ids, mask, make_policy("full"),
                                                     max_new_tokens=args.new_tokens)
    rows = [{"policy": "full", "decode_seconds": full_decode, "seconds": time.perf_counter() - t0}]
    for name in args.policies.split(","):
        for budget in map(int, args.budgets.split(",")):
            t0 = time.perf_counter()
            new, _, stats, _, decode = speculative_tokens(
                model, ids, mask, Speculation(make_policy(name, budget), args.draft_tokens),
                max_new_tokens=args.new_tokens)
            row = {"policy": name, "budget": budget, **stats["speculation"], "decode_seconds": decode,
                   "seconds": time.perf_counter() - t0, "lossless": bool(torch.equal(new, expected))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "text": "books/test, tokens 10,000 onward of each book",
            "threads": torch.get_num_threads()}
    (OUT / f"{args.model}-acceptance.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    plot(rows, OUT / f"{args.model}-acceptance.png", f"{args.model}: drafts accepted ({args.prompts} x "
                                                     f"{args.prompt_tokens}-token prompts, K={args.draft_tokens})")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"):
        mine = [r for r in rows if r["policy"] == name]
        ax.plot([r["budget"] for r in mine], [r["acceptance_rate"] for r in mine], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft cache budget (tokens)")
    ax.set_ylabel("drafts accepted")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
