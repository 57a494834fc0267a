"""A/B in one process: the regional compiled step with blocks of several sizes (decoder layers a compiled block
holds), on the same caches: each size's first call (its compile: cold with an empty compile cache, warm on a second
run in the same folder) and the median step, interleaved; batch 1, caches filled to the context with random K/V.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python scripts/block_size_ab.py MODEL SIZE,SIZE,...  # again: warm
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from direct_calls_ab import SHAPES, filled_cache, interleaved_times  # (scripts/, beside this one)

import sparsegen
from sparsegen.engine.step import DecodeStep


def main() -> None:
    torch.set_num_threads(2)
    model_name, sizes = sys.argv[1], [int(size) for size in sys.argv[2].split(",")]
    model, _ = sparsegen.load(model_name)
    for policy, budget, context in SHAPES:
        steps = {}
        for size in sizes:
            steps[size] = DecodeStep(model, compile="regional", notice=False)
            steps[size].block_size = size
        caches = {size: filled_cache(model, policy, budget, context) for size in sizes}
        token, position, first = torch.tensor([5]), torch.tensor([context]), {}
        with torch.inference_mode():
            for size, step in steps.items():
                started = time.perf_counter()
                first[size] = step(caches[size], token, position)
                seconds = time.perf_counter() - started
                for _ in range(3):
                    step(caches[size], token, position)
                print(f"{model_name} {policy} {context}: blocks of {size}: first call {seconds:.1f} s", flush=True)
            times = interleaved_times(steps, caches, token, position)
        ms = {size: statistics.median(times[size]) * 1e3 for size in sizes}
        print(f"{model_name} {policy} {context}: step " + ", ".join(
            f"blocks of {size} {ms[size]:.2f} ms ({ms[size] / ms[sizes[-1]]:.3f}x)" for size in sizes) +
            "; first logits differ by " + ", ".join(
            f"{(first[size] - first[sizes[-1]]).abs().max().item():.1e}" for size in sizes), flush=True)


if __name__ == "__main__":
    main()
