"""A/B in one process: ``DecodeStep``'s direct graph calls (``sparsegen.engine.graph_calls``: the whole step's graph,
or a regional step's blocks) against the same compiled graphs through dynamo's public path every call, interleaved;
SmolLM2 at its GGUF's widths, batch 1, caches filled as a prefill would leave them (docs/benchmarks.md, "The compiled
step's direct calls").

    python scripts/direct_calls_ab.py [regional|whole ...]   # default: both
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time

import torch

import sparsegen
from sparsegen.bench.fill import fill_random
from sparsegen.engine.step import COMPILE_MODES, DecodeStep
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.spec import kv_shape

SHAPES = (("full", None, 512), ("h2o", 1024, 2048), ("streaming", 1024, 8192))
TURNS, STEPS = 6, 16


def filled_cache(model, policy: str, budget: int | None, context: int) -> EvictionCache:
    """A batch-1 cache of ``context`` random K/V, as a prefill would leave it (the same seed every time)."""
    _, kv_heads, head_dim = kv_shape(model.config)
    cache = EvictionCache(model, make_policy(policy, budget), expected_length=context + 400)
    fill_random(cache, 1, context, kv_heads, head_dim, torch.float32, torch.device("cpu"),
                torch.Generator().manual_seed(0))
    return cache


def interleaved_times(steps: dict[str, DecodeStep], caches: dict, token: torch.Tensor,
                      position: torch.Tensor) -> dict[str, list[float]]:
    """Each step's seconds over TURNS turns of STEPS steps on its own cache, the steps taking turns."""
    times = {name: [] for name in steps}
    for _ in range(TURNS):
        for name, step in steps.items():
            for _ in range(STEPS):
                started = time.perf_counter()
                step(caches[name], token, position)
                times[name].append(time.perf_counter() - started)
    return times


def main() -> None:
    torch.set_num_threads(2)
    model, _ = sparsegen.load("smollm2")
    for mode, (policy, budget, context) in itertools.product(sys.argv[1:] or COMPILE_MODES, SHAPES):
        steps = {"direct": DecodeStep(model, compile=mode), "public": DecodeStep(model, compile=mode)}
        steps["public"].direct_calls = False  # every step through dynamo: its guards, its bytecode
        caches = {name: filled_cache(model, policy, budget, context) for name in steps}
        token, position = torch.tensor([5]), torch.tensor([context])
        with torch.inference_mode():
            for name, step in steps.items():
                for _ in range(4):  # (the first compiles; the next find the graph)
                    step(caches[name], token, position)
            times = interleaved_times(steps, caches, token, position)
        direct, public = (statistics.median(times[name]) * 1e3 for name in ("direct", "public"))
        print(f"{mode} {policy} {context}: direct {direct:.2f} ms, public {public:.2f} ms, public/direct "
              f"{public / direct:.3f}; unguarded {steps['direct'].unguarded_steps}/{steps['direct'].compiled_steps}")


if __name__ == "__main__":
    main()
