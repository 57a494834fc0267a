"""The linears of one token (every block's fused q/k/v, o, fused gate/up and down, each block its own weights, so
they come from memory, not cache) under ``--weights w8a8``, ``w5a8`` and ``w4a8``, and w4a8's weights dequantized to
fp32 (``fp32``: PyTorch's float matmul), interleaved in one process: ms for all of them at ROWS tokens a call (a
decode step is 1, a batch of 8 steps 8, a prefill chunk more). "op": the kernels alone, as the compiled step calls
them; "module": the eager modules (w8a8's input rotation and scaling included).

    python scripts/linear_kernels.py [--model smollm2|gemma3-270m] [ROWS ...]   (default smollm2; 1 4 8 16 64 512)
"""

import argparse
import statistics
import time

import torch

from sparsegen.quant import fast

SHAPES = {"smollm2": ([(576, 960), (576, 576), (576, 3072), (1536, 576)], 30),  # q/k/v, o, gate/up, down (in -> out)
          "gemma3-270m": ([(640, 1536), (1024, 640), (640, 4096), (2048, 640)], 18)}  # ... and its blocks
LINEARS = {"w8a8": fast.W8A8Linear, "w5a8": fast.W5A8Linear, "w4a8": fast.W4A8Linear}
KINDS = (*LINEARS, "fp32")  # fp32: w4a8's weights dequantized, in PyTorch's float matmul (what a prompt once ran)

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", choices=SHAPES, default="smollm2")
parser.add_argument("rows", type=int, nargs="*", default=[1, 4, 8, 16, 64, 512])
args = parser.parse_args()
shapes, layers = SHAPES[args.model]
torch.set_num_threads(2)
torch.manual_seed(0)
kernels = {kind: [made(torch.nn.Linear(i, o, bias=False)) for _ in range(layers) for i, o in shapes]
           for kind, made in LINEARS.items()}
kernels["fp32"] = [torch.nn.Linear(k.in_features, k.out_features, bias=False) for k in kernels["w4a8"]]
for dense, packed in zip(kernels["fp32"], kernels["w4a8"]):
    dense.weight.data = packed.dequantized()
megabytes = {kind: sum(t.numel() * t.element_size() for k in linears
                       for t in (k.stored_tensors() if hasattr(k, "stored_tensors") else
                                 [k.blocks] if hasattr(k, "blocks") else [k.weight])) / 1e6
             for kind, linears in kernels.items()}
print(f"{args.model}, weights read a call: " + ", ".join(f"{kind} {mb:.1f} MB" for kind, mb in megabytes.items()))


def op_call(linear):
    """The kernel call alone, as the compiled step makes it."""
    if isinstance(linear, torch.nn.Linear):
        return linear
    if isinstance(linear, fast.W8A8Linear):
        return lambda x: torch.ops.sparsegen.w8a8_linear(x, linear.handle, linear.out_features)
    op = torch.ops.sparsegen.w5a8_linear if isinstance(linear, fast.W5A8Linear) else torch.ops.sparsegen.w4a8_linear
    return lambda x: op(x, linear.blocks, linear.out_features)


calls = {"module": {kind: [(k, k) for k in linears] for kind, linears in kernels.items()},
         "op": {kind: [(k, op_call(k)) for k in linears] for kind, linears in kernels.items()}}
with torch.inference_mode():
    for rows in args.rows:
        inputs = {width: torch.randn(rows, width) for width in {i for i, _ in shapes}}
        line = []
        for how, by_kind in calls.items():
            times = {kind: [] for kind in by_kind}
            for _ in range(5 if rows >= 64 else 20):
                for kind, pairs in by_kind.items():
                    start = time.perf_counter()
                    for linear, call in pairs:
                        call(inputs[linear.in_features])
                    times[kind].append(time.perf_counter() - start)
            ms = {kind: statistics.median(times[kind][1:]) * 1e3 for kind in KINDS}
            line.append(f"{how}: " + ", ".join(f"{kind} {ms[kind]:7.2f} ms ({ms['w8a8'] / ms[kind]:.2f}x)"
                                                for kind in KINDS))
        print(f"{rows:4d} rows   " + "   ".join(line))
