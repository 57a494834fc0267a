"""Compress once, ask many: the cost of N questions about one document, with the document compressed once
(``sparsegen.compress``, saved and loaded) against compressing it again inside every ``generate`` (kvpress's protocol
as one call), in one run. Prints a Markdown table; the answers of the two must be identical.

    python scripts/context_reuse.py --model smollm2 --tokens 4096 --policies full,snapkv,h2o --budget 0.2
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import sparsegen
from sparsegen.data import data_dir
from sparsegen.engine.context import CompressedContext

QUESTIONS = ["\n\nQuestion: Who is the narrator? Answer:", "\n\nQuestion: Where does this happen? Answer:",
             "\n\nQuestion: What happens first? Answer:", "\n\nQuestion: Who arrives at the end? Answer:",
             "\n\nQuestion: What is the weather like? Answer:"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--book", default=str(data_dir() / "books" / "test" / "dracula.txt"))
    parser.add_argument("--tokens", type=int, default=4096, help="context length, tokens")
    parser.add_argument("--policies", default="full,snapkv,h2o")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    model, tokenizer = sparsegen.load(args.model)
    ids = tokenizer(Path(args.book).read_text(encoding="utf-8"))["input_ids"][2000:2000 + args.tokens]
    document = tokenizer.decode(ids)
    print(f"{args.model}: a {len(tokenizer(document)['input_ids']):,}-token document, {len(QUESTIONS)} questions, "
          f"{args.max_new_tokens} tokens each\n")
    print("| policy | compress once, s | file, MiB | per question after it, s | compress inside each question, s "
          "(per question) | speedup over the questions | same answers |")
    print("|---|---|---|---|---|---|---|")
    for name in args.policies.split(","):
        spec = sparsegen.PolicySpec.sharing(name, float(args.budget))
        t0 = time.perf_counter()
        context = sparsegen.compress(model, tokenizer, document, spec)
        with tempfile.TemporaryDirectory() as folder:
            path = context.save(Path(folder) / "doc.safetensors")
            size = path.stat().st_size
            context = CompressedContext.load(path, model)
        compress_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        once = [sparsegen.generate(model, tokenizer, context=context, question=q, max_new_tokens=args.max_new_tokens,
                                   stop_at_eos=False).text for q in QUESTIONS]
        reuse_seconds = (time.perf_counter() - t0) / len(QUESTIONS)
        t0 = time.perf_counter()
        each = [sparsegen.generate(model, tokenizer, policy=spec, context=document, question=q,
                                   max_new_tokens=args.max_new_tokens, stop_at_eos=False).text for q in QUESTIONS]
        each_seconds = (time.perf_counter() - t0) / len(QUESTIONS)
        total_once = compress_seconds + reuse_seconds * len(QUESTIONS)
        print(f"| {name} | {compress_seconds:.2f} | {size / 2**20:.1f} | {reuse_seconds:.2f} | {each_seconds:.2f} | "
              f"{each_seconds * len(QUESTIONS) / total_once:.2f}x | {once == each} |", flush=True)


if __name__ == "__main__":
    main()
