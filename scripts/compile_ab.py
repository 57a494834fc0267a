"""A/B in one process: the regional compiled step (a block of decoder layers compiled once, run for every block) and
the whole-graph one, on the same caches: each mode's first call (its compile: cold with an empty compile cache,
warm on a second run) and the median step, interleaved; the GGUF models at their own widths, batch 1, caches
filled to the context with random K/V (docs/benchmarks.md, "Regional compilation").

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python scripts/compile_ab.py [MODEL ...]   # cold; again, same folder: warm
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import sparsegen
from sparsegen.bench.fill import fill_random
from sparsegen.engine.step import COMPILE_MODES, DecodeStep
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.spec import kv_shape

MODELS = ("smollm2", "gemma3-270m")
SHAPES = (("full", None, 512), ("h2o", 1024, 2048), ("streaming", 1024, 8192))
TURNS, STEPS = 6, 16


def main() -> None:
    torch.set_num_threads(2)
    for model_name in sys.argv[1:] or MODELS:
        model, _ = sparsegen.load(model_name)
        _, kv_heads, head_dim = kv_shape(model.config)
        for policy, budget, context in SHAPES:
            steps = {mode: DecodeStep(model, compile=mode, notice=False) for mode in COMPILE_MODES}
            caches, first, times = {}, {}, {mode: [] for mode in steps}
            token, position = torch.tensor([5]), torch.tensor([context])
            with torch.inference_mode():
                for mode, step in steps.items():
                    caches[mode] = EvictionCache(model, make_policy(policy, budget), expected_length=context + 400)
                    fill_random(caches[mode], 1, context, kv_heads, head_dim, torch.float32, torch.device("cpu"),
                                torch.Generator().manual_seed(0))
                    started = time.perf_counter()
                    logits = step(caches[mode], token, position)
                    first[mode] = time.perf_counter() - started, logits
                    for _ in range(3):
                        step(caches[mode], token, position)
                for _ in range(TURNS):
                    for mode, step in steps.items():
                        for _ in range(STEPS):
                            started = time.perf_counter()
                            step(caches[mode], token, position)
                            times[mode].append(time.perf_counter() - started)
            ms = {mode: statistics.median(times[mode]) * 1e3 for mode in steps}
            difference = (first["regional"][1] - first["whole"][1]).abs().max().item()
            print(f"{model_name} {policy} {context}: first call regional {first['regional'][0]:.1f} s, whole "
                  f"{first['whole'][0]:.1f} s; step regional {ms['regional']:.2f} ms, whole {ms['whole']:.2f} ms, "
                  f"regional/whole {ms['regional'] / ms['whole']:.3f}; first logits differ by {difference:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
