"""A/B in one process: the regional compiled step (a block of decoder layers compiled once, run for every block) and
the whole-graph one, on the same caches: each mode's first call (its compile: cold with an empty compile cache,
warm on a second run) and the median step, interleaved; the GGUF models at their own widths, batch 1, caches
filled to the context with random K/V (docs/benchmarks.md, "What a compile costs: regional compilation").

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python scripts/compile_ab.py [MODEL ...]   # cold; again, same folder: warm
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from direct_calls_ab import SHAPES, filled_cache, interleaved_times  # (scripts/, beside this one)

import sparsegen
from sparsegen.engine.step import COMPILE_MODES, DecodeStep

MODELS = ("smollm2", "gemma3-270m")


def main() -> None:
    torch.set_num_threads(2)
    for model_name in sys.argv[1:] or MODELS:
        model, _ = sparsegen.load(model_name)
        for policy, budget, context in SHAPES:
            steps = {mode: DecodeStep(model, compile=mode, notice=False) for mode in COMPILE_MODES}
            caches = {mode: filled_cache(model, policy, budget, context) for mode in steps}
            token, position, first = torch.tensor([5]), torch.tensor([context]), {}
            with torch.inference_mode():
                for mode, step in steps.items():
                    started = time.perf_counter()
                    logits = step(caches[mode], token, position)
                    first[mode] = time.perf_counter() - started, logits
                    for _ in range(3):
                        step(caches[mode], token, position)
                times = interleaved_times(steps, caches, token, position)
            ms = {mode: statistics.median(times[mode]) * 1e3 for mode in steps}
            difference = (first["regional"][1] - first["whole"][1]).abs().max().item()
            print(f"{model_name} {policy} {context}: first call regional {first['regional'][0]:.1f} s, whole "
                  f"{first['whole'][0]:.1f} s; step regional {ms['regional']:.2f} ms, whole {ms['whole']:.2f} ms, "
                  f"regional/whole {ms['regional'] / ms['whole']:.3f}; first logits differ by {difference:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
