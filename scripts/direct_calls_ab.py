"""A/B in one process: ``DecodeStep``'s direct graph calls (``sparsegen.engine.graph_calls``) against the same
compiled graphs through dynamo's public path every step, interleaved; SmolLM2 at its GGUF's widths, batch 1, caches
filled as a prefill would leave them (docs/benchmarks.md, "The compiled step's direct calls").

    python scripts/direct_calls_ab.py
"""

from __future__ import annotations

import statistics
import time

import torch

import sparsegen
from sparsegen.bench.fill import fill_random
from sparsegen.engine.step import DecodeStep
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.spec import kv_shape

SHAPES = (("full", None, 512), ("h2o", 1024, 2048), ("streaming", 1024, 8192))
TURNS, STEPS = 6, 16


def main() -> None:
    torch.set_num_threads(2)
    model, _ = sparsegen.load("smollm2")
    _, kv_heads, head_dim = kv_shape(model.config)
    for policy, budget, context in SHAPES:
        steps = {"direct": DecodeStep(model), "public": DecodeStep(model)}
        steps["public"].direct_calls = False  # every step through dynamo: its guards, its bytecode
        caches = {}
        for name in steps:
            caches[name] = EvictionCache(model, make_policy(policy, budget), expected_length=context + 400)
            fill_random(caches[name], 1, context, kv_heads, head_dim, torch.float32, torch.device("cpu"),
                        torch.Generator().manual_seed(0))
        token, position = torch.tensor([5]), torch.tensor([context])
        times = {name: [] for name in steps}
        with torch.inference_mode():
            for name, step in steps.items():
                for _ in range(4):  # (the first compiles; the next find the graph)
                    step(caches[name], token, position)
            for _ in range(TURNS):
                for name, step in steps.items():
                    for _ in range(STEPS):
                        started = time.perf_counter()
                        step(caches[name], token, position)
                        times[name].append(time.perf_counter() - started)
        direct, public = (statistics.median(times[name]) * 1e3 for name in ("direct", "public"))
        print(f"{policy} {context}: direct {direct:.2f} ms, public {public:.2f} ms, public/direct "
              f"{public / direct:.3f}; unguarded {steps['direct'].unguarded_steps}/{steps['direct'].compiled_steps}")


if __name__ == "__main__":
    main()
