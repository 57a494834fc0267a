"""Which KV heads still hold a RULER needle after query-aware compression, layer by layer, under each policy: the
prompt (question included) in one pass through the policy's cache, then every head's held tokens checked for the
needle's. Shows where policies that keep the same number of tokens part (e.g. Ada-KV's per-head shares against
SnapKV's equal ones).

    .venv/bin/python scripts/needle_heads.py --model smollm2 --policies snapkv,ada-snapkv --budget 0.2
"""

from __future__ import annotations

import argparse

import torch

import sparsegen
from sparsegen.data import data_dir
from sparsegen.eval import ruler
from sparsegen.eval.inspect import kept_tokens
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.compat import cache_kwargs


def needle_positions(tokenizer, ids: list[int], answer: str) -> list[int]:
    """Where the needle's value sits in the prompt (as tokenized there, with or without a leading space)."""
    for text in (answer, " " + answer):
        piece = tokenizer.encode(text, add_special_tokens=False)
        for start in range(len(ids) - len(piece) + 1):
            if ids[start:start + len(piece)] == piece:
                return list(range(start, start + len(piece)))
    raise ValueError(f"the needle {answer!r} is not in the prompt as one run of tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--policies", default="snapkv,ada-snapkv")
    parser.add_argument("--budget", type=float, default=0.2, help="share of the context kept")
    parser.add_argument("--task", default="niah_single_1", help="a single-needle RULER task")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=2)
    args = parser.parse_args()
    model, tokenizer = sparsegen.load(args.model)
    hay = ruler.Haystack(tokenizer, (data_dir() / "books" / "test" / "great_expectations.txt").read_text())
    chat = bool(getattr(tokenizer, "chat_template", None))
    for sample in ruler.make_samples(hay, args.task, args.length, args.samples, chat=chat):
        needle = needle_positions(tokenizer, sample.ids, sample.answers[0])
        print(f"depth {sample.depth}: needle at tokens {needle[0]}-{needle[-1]} of {len(sample.ids)}")
        ids = torch.tensor([sample.ids])
        for name in args.policies.split(","):
            cache = EvictionCache(model, make_policy(name, args.budget, sample.context_tokens),
                                  chunk_size=len(sample.ids))
            with torch.inference_mode():
                model(input_ids=ids, **cache_kwargs(cache))
            heads = cache.layers[0].keys.shape[1] * cache.layers[0].fan
            kept = [kept_tokens(layer, heads) for layer in cache.layers]
            holding = [sum(set(needle) <= set(tokens) for tokens in layer) for layer in kept]
            print(f"  {name:>12}: heads holding the whole needle, by layer {holding} (total {sum(holding)})")
            sizes = [len(tokens) for layer in kept for tokens in layer]
            print(f"  {'':>12}  tokens per head, smallest and largest: {min(sizes)}, {max(sizes)}")


if __name__ == "__main__":
    main()
