"""A/B in one process: a GGUF model's prompt chunks through its integer kernels (8-bit inputs) against the same
weights dequantized to fp32 (``sparsegen.quant.fast.prompt_matmuls``, what ``prefill`` runs), interleaved.

    python scripts/prompt_matmuls.py smollm2 --tokens 512 --turns 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import sparsegen
from sparsegen.quant.fast import prompt_matmuls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = sparsegen.load(args.model)  # (its GGUF's own widths)
    ids = torch.randint(100, 20000, (1, args.tokens), generator=torch.Generator().manual_seed(0))

    def seconds(dequantized: bool) -> float:
        with torch.inference_mode(), prompt_matmuls() if dequantized else contextlib.nullcontext():
            started = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            return time.perf_counter() - started

    seconds(False), seconds(True)  # (warm-up: first calls allocate)
    times = {False: [], True: []}
    for _ in range(args.turns):
        for dequantized in (False, True):
            times[dequantized].append(seconds(dequantized))
    kernels, dense = (statistics.median(times[d]) for d in (False, True))
    print(f"{args.model}, {args.tokens} tokens, {args.threads} threads: integer kernels {args.tokens / kernels:.0f} "
          f"tok/s, dequantized fp32 {args.tokens / dense:.0f} tok/s ({kernels / dense:.2f}x)")


if __name__ == "__main__":
    main()
