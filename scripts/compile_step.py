"""Eager vs compiled ``DecodeStep`` (the step every path runs) in one run, on a cache filled to CONTEXT tokens with
random K/V (``fill_random``): median ms per step over STEPS steps after the compile and warm-up, the first compiled
call's wall time (compile, and on CUDA the graph's recording), the largest difference of the first step's logits
(both steps start from the same cache) and whether both steps pick the same tokens (random K/V and weights can leave
near-ties that a fused kernel's rounding flips, then the two runs part ways).
On CUDA the compiled step is a CUDA graph replay (``mode="reduce-overhead"``), every step fixed-shape.

    python scripts/compile_step.py MODEL POLICY CONTEXT [--device cuda] [--dtype bfloat16] [--batch 8] [--weights int4]
"""

import argparse
import statistics
import time

import torch

import sparsegen
from sparsegen.bench.fill import fill_random
from sparsegen.engine.step import DecodeStep
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.loading import load_config
from sparsegen.models.spec import kv_shape
from sparsegen.models.synthetic import is_random, random_model
from sparsegen.quant.restore import WEIGHTS, quantize_weights

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("policy")
parser.add_argument("context", type=int)
parser.add_argument("--budget", type=int, default=1024)
parser.add_argument("--device", default="cpu")
parser.add_argument("--dtype", default=None)
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--steps", type=int, default=64)
parser.add_argument("--threads", type=int, default=None)
parser.add_argument("--weights", choices=WEIGHTS, default="fp32")
args = parser.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)
if is_random(args.model):  # a real shape with random weights: what a step costs does not depend on them
    model = random_model(load_config(args.model), args.device, getattr(torch, args.dtype or "float32")).eval()
else:
    model, _ = sparsegen.load(args.model, device=args.device, dtype=args.dtype)
if args.weights != "fp32":
    quantize_weights(model, args.weights)
device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
_, kv_heads, head_dim = kv_shape(model.config)


def synchronize():
    if device.type == "cuda":
        torch.cuda.synchronize()


def fresh() -> EvictionCache:
    cache = EvictionCache(model, make_policy(args.policy, None if args.policy == "full" else args.budget),
                          expected_length=args.context + 2 * args.steps + 8)
    generator = torch.Generator(device=device).manual_seed(0)
    fill_random(cache, args.batch, args.context, kv_heads, head_dim, dtype, device, generator)
    return cache


def run(step: DecodeStep) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """(first call's seconds, median ms of the steps after three warm-ups, the tokens picked, the first logits)."""
    cache, picked, times, first = fresh(), [], [], None
    token = torch.full((args.batch,), 5, device=device)
    position = torch.full((args.batch,), args.context, device=device)
    for _ in range(args.steps + 4):
        synchronize()
        start = time.perf_counter()
        logits = step(cache, token, position)
        token = logits.argmax(-1)
        synchronize()
        first = logits.float() if first is None else first
        times.append(time.perf_counter() - start)
        position = position + 1
        picked.append(token)
    return times[0], statistics.median(times[4:]) * 1000, torch.stack(picked), first


with torch.inference_mode():
    _, eager_ms, eager_tokens, eager_logits = run(DecodeStep(model))
    compiled = DecodeStep(model, compile=True)
    first_s, compiled_ms, compiled_tokens, compiled_logits = run(compiled)
print(f"{args.model} {args.policy} context {args.context} batch {args.batch} {dtype} on {device}: eager {eager_ms:.2f} "
      f"ms/step, compiled {compiled_ms:.2f} ms/step ({eager_ms / compiled_ms:.2f}x; {compiled.compiled_steps} of "
      f"{args.steps + 4} steps compiled), first compiled call {first_s:.1f} s, first logits max |diff| "
      f"{(eager_logits - compiled_logits).abs().max():.2e} (of max |logit| {eager_logits.abs().max():.1f}), "
      f"same tokens {torch.equal(eager_tokens, compiled_tokens)}")
