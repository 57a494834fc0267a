"""``--weights w8a8``'s kernel call from C++ (``sparsegen/quant/w8a8_linear.cpp``) against the Python call it
replaced, in one run: the compiled decode step on a cache filled to CONTEXT tokens with random K/V, the op's CPU
kernel switched between the two in interleaved rounds (a Python kernel registered over the C++ one, then removed):
median ms a step each, their ratio, and whether both give the same logits.

    python scripts/w8a8_kernel_call.py MODEL CONTEXT [--policy full] [--rounds 6] [--steps 32] [--json OUT]
"""

import argparse
import json
import statistics
import time
import warnings

import torch

import sparsegen
from sparsegen.bench.fill import fill_random
from sparsegen.engine.step import DecodeStep
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.spec import kv_shape
from sparsegen.quant import fast

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("context", type=int)
parser.add_argument("--policy", default="full")
parser.add_argument("--budget", type=int, default=1024)
parser.add_argument("--rounds", type=int, default=6)
parser.add_argument("--steps", type=int, default=32)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--json", default=None)
args = parser.parse_args()
torch.set_num_threads(args.threads)
model, _ = sparsegen.load(args.model)
fast.quantize_weights(model, "w8a8")
if fast._native_kernels() != "c++":
    raise SystemExit("the C++ kernel call did not build here (see the warning above): nothing to compare")
_, kv_heads, head_dim = kv_shape(model.config)
step = DecodeStep(model, compile=True)


def python_kernel() -> torch.library.Library:
    """The Python kernel registered over the C++ one until the returned fragment is destroyed."""
    fragment = torch.library.Library("sparsegen", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
        fragment.impl("w8a8_linear", fast._w8a8_linear, "CPU")
    return fragment


def timed() -> tuple[list[float], torch.Tensor]:
    """Per-step seconds after two warm-ups, and the first step's logits (every round starts from the same cache)."""
    cache = EvictionCache(model, make_policy(args.policy, None if args.policy == "full" else args.budget),
                          expected_length=args.context + args.steps + 8)
    fill_random(cache, 1, args.context, kv_heads, head_dim, torch.float32, torch.device("cpu"),
                      torch.Generator().manual_seed(0))
    token, position, times, first = torch.tensor([5]), torch.tensor([args.context]), [], None
    for _ in range(args.steps + 2):
        start = time.perf_counter()
        logits = step(cache, token, position)
        times.append(time.perf_counter() - start)
        first = logits if first is None else first
        token, position = logits.argmax(-1), position + 1
    return times[2:], first


with torch.inference_mode():
    started = time.perf_counter()
    timed()  # (the compile)
    compile_s = time.perf_counter() - started
    seconds = {"c++": [], "python": []}
    logits = {}
    for _ in range(args.rounds):
        for kernel in ("c++", "python"):
            fragment = python_kernel() if kernel == "python" else None
            times, logits[kernel] = timed()
            seconds[kernel] += times
            if fragment is not None:
                fragment._destroy()
ms = {kernel: statistics.median(times) * 1000 for kernel, times in seconds.items()}
result = {"model": args.model, "policy": args.policy, "context": args.context, "threads": args.threads,
          "rounds": args.rounds, "steps_per_round": args.steps, "compile_s": round(compile_s, 1),
          "ms_per_step": {k: round(v, 3) for k, v in ms.items()}, "speedup": round(ms["python"] / ms["c++"], 3),
          "same_logits": torch.equal(logits["c++"], logits["python"]), "torch": torch.__version__}
print(json.dumps(result))
if args.json:
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
