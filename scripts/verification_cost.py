"""What a speculative verification costs: ``tokens`` new tokens a row fed over a full cache of ``context`` random
tokens (``sparsegen.bench.fill.fill_random``), attended by ``sparsegen::decode_attention`` and by the grouped matmuls
(``cache.native_decode`` off), interleaved in one process, each forward followed by ``forget_last`` as a round does.

    PYTHONPATH=. .venv/bin/python scripts/verification_cost.py smollm2 --weights w8a8 --batch 8 --context 8192 \
        --tokens 1,5 --repeats 5 [--json OUT]

A row per token count: the median milliseconds each way and their ratio, and the largest difference between the two
ways' logits (fp32 weights: float rounding; w8a8 rounds each token's inputs to 7 bits, so a last-bit difference in
attention can flip a rounding and grow through the layers of a cache of random K/V).
"""

import argparse
import json
import statistics
import time

import torch

import sparsegen
from sparsegen.bench.fill import fill_random
from sparsegen.engine.step import forward
from sparsegen.kv import EvictionCache
from sparsegen.kv.policies.full import Full
from sparsegen.kv.rollback import forget_last
from sparsegen.models.spec import kv_shape


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--weights", default="fp32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--tokens", default="1,5", help="comma-separated token counts a row")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = sparsegen.load(args.model, weights=args.weights, tokenizer=False)
    _, kv_heads, head_dim = kv_shape(model.config)
    counts = [int(n) for n in args.tokens.split(",")]
    cache = EvictionCache(model, Full(), expected_length=args.context + max(counts) + 1, rollback=max(counts))
    fill_random(cache, args.batch, args.context, kv_heads, head_dim, torch.float32, torch.device("cpu"),
                      torch.Generator().manual_seed(0))
    if not cache.native_decode:
        raise SystemExit("sparsegen::decode_attention is not built here (see the warning above): nothing to compare")

    def run(tokens: int, kernel: bool) -> tuple[float, torch.Tensor]:
        cache.native_decode = kernel
        ids = torch.randint(0, model.config.vocab_size, (args.batch, tokens),
                            generator=torch.Generator().manual_seed(1))
        positions = torch.full((args.batch, 1), args.context) + torch.arange(tokens)
        started = time.perf_counter()
        with torch.no_grad():
            logits = forward(model, cache, ids, positions)
        seconds = time.perf_counter() - started
        forget_last(cache, tokens)
        return seconds, logits

    rows = []
    for tokens in counts:
        kernel_logits, matmuls_logits = run(tokens, True)[1], run(tokens, False)[1]  # (also the warm-up)
        difference = (kernel_logits - matmuls_logits).abs().max().item()
        largest = matmuls_logits.abs().max().item()
        times = {"kernel": [], "matmuls": []}
        for _ in range(args.repeats):
            for way in times:
                times[way].append(run(tokens, way == "kernel")[0])
        kernel_ms, matmuls_ms = (statistics.median(times[way]) * 1e3 for way in ("kernel", "matmuls"))
        rows.append({"tokens": tokens, "kernel_ms": round(kernel_ms, 1), "matmuls_ms": round(matmuls_ms, 1),
                     "matmuls_over_kernel": round(matmuls_ms / kernel_ms, 2), "max_logit_difference": difference,
                     "max_logit": largest})
        print(f"{tokens} tokens a row, {args.batch} x {args.context:,}: kernel {kernel_ms:.0f} ms, matmuls "
              f"{matmuls_ms:.0f} ms ({matmuls_ms / kernel_ms:.2f}x); logits (up to {largest:.1f}) differ by at most "
              f"{difference:.2g}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "weights": args.weights, "batch": args.batch, "context": args.context,
                       "threads": args.threads, "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
