"""What compressing a context costs, against its plain prefill, in one run: ``sparsegen.compress`` of the same
book context under each policy (``full`` first: the prefill alone), interleaved ``repeats`` times, the fastest of each
and its multiple of ``full``'s. ``--scores-per-block`` A/Bs the grouped attention's block of scores
(``sparsegen.kv.attention.SCORES_PER_BLOCK``; 0: blocks of ``QUERY_BLOCK`` queries whatever their keys, as before
2026-12-05).

    PYTHONPATH=. .venv/bin/python scripts/compression_cost.py --model smollm2 --tokens 4096 \
        --policies full,h2o,kvzip --budget 0.3 --scores-per-block 0,2097152
    (--policies full,kvzap-global,kvzip-global --scorer runs/scorers/smollm2.safetensors: the learned scorer's)
"""

from __future__ import annotations

import argparse
import time

import torch

import sparsegen
import sparsegen.kv.attention as attention
from sparsegen.data import data_dir
from sparsegen.kv import PolicySpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--book", default=str(data_dir() / "books" / "test" / "great_expectations.txt"))
    parser.add_argument("--tokens", type=int, default=4096, help="context length, tokens")
    parser.add_argument("--policies", default="full,h2o,kvzip")
    parser.add_argument("--budget", type=float, default=0.3)
    parser.add_argument("--scores-per-block", default=str(attention.SCORES_PER_BLOCK),
                        help="comma-separated values to A/B (0: blocks of QUERY_BLOCK queries)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scorer", help="kvzap's and kvzap-global's fitted scorer (`sparsegen fit-scorer`)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = sparsegen.load(args.model)
    ids = tokenizer(open(args.book).read())["input_ids"][:args.tokens]
    context = tokenizer.decode(ids)
    sparsegen.compress(model, tokenizer, context[:2000], "full")  # (first-call costs out of the rows)
    blocks = [int(b) for b in args.scores_per_block.split(",")]
    policies = args.policies.split(",")
    best: dict[tuple[int, str], float] = {}
    for _ in range(args.repeats):
        for block in blocks:
            attention.SCORES_PER_BLOCK = block or 1 << 62
            for policy in policies:
                start = time.perf_counter()
                options = {"scorer": args.scorer} if policy.startswith("kvzap") else {}
                spec = PolicySpec(policy, None if policy == "full" else args.budget, options)
                sparsegen.compress(model, tokenizer, context, spec)
                seconds = time.perf_counter() - start
                best[block, policy] = min(best.get((block, policy), seconds), seconds)
    print(f"{args.model}, a {len(ids)}-token context, budget {args.budget}, {args.threads} threads, "
          f"fastest of {args.repeats}\n")
    print("| scores a block | " + " | ".join(policies) + " |")
    print("|---|" + "---|" * len(policies))
    for block in blocks:
        full = best.get((block, "full"))
        cells = [f"{best[block, p]:.1f} s" + (f" ({best[block, p] / full:.2f}×)" if full and p != "full" else "")
                 for p in policies]
        print(f"| {block or 'QUERY_BLOCK queries'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
