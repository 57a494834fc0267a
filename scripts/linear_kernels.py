"""The linears of one SmolLM2 token (30 blocks' fused q/k/v, o, fused gate/up and down, each block its own weights, so
they come from memory, not cache) under ``--weights w8a8`` and ``--weights w4a8``, interleaved in one process: ms for
all of them at ROWS tokens a call (a decode step is 1, a batch of 8 steps 8, a prefill chunk more). "op": the kernels
alone, as the compiled step calls them; "module": the eager modules (w8a8's input rotation and scaling included).

    python scripts/linear_kernels.py [ROWS ...]   (default 1 4 8 16 64 512)
"""

import statistics
import sys
import time

import torch

from sparsegen.quant import fast

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # SmolLM2's q/k/v, o, gate/up, down (in -> out)
LAYERS = 30

torch.set_num_threads(2)
torch.manual_seed(0)
rows_asked = [int(arg) for arg in sys.argv[1:]] or [1, 4, 8, 16, 64, 512]
kernels = {kind: [fast._KERNELS[kind](torch.nn.Linear(i, o, bias=False)) for _ in range(LAYERS) for i, o in SHAPES]
           for kind in ("w8a8", "w4a8")}
megabytes = {kind: sum(t.numel() * t.element_size() for k in linears
                       for t in (k.stored_tensors() if hasattr(k, "stored_tensors") else [k.blocks])) / 1e6
             for kind, linears in kernels.items()}
print(f"weights read a call: w8a8 {megabytes['w8a8']:.1f} MB, w4a8 {megabytes['w4a8']:.1f} MB")


def op_call(linear):
    """The kernel call alone, as the compiled step makes it."""
    if isinstance(linear, fast.W8A8Linear):
        return lambda x: torch.ops.sparsegen.w8a8_linear(x, linear.handle, linear.out_features)
    return lambda x: torch.ops.sparsegen.w4a8_linear(x, linear.blocks, linear.out_features)


calls = {"module": {kind: [(k, k) for k in linears] for kind, linears in kernels.items()},
         "op": {kind: [(k, op_call(k)) for k in linears] for kind, linears in kernels.items()}}
with torch.inference_mode():
    for rows in rows_asked:
        inputs = {width: torch.randn(rows, width) for width in (576, 1536)}
        line = []
        for how, by_kind in calls.items():
            times = {kind: [] for kind in by_kind}
            for _ in range(5 if rows >= 64 else 20):
                for kind, pairs in by_kind.items():
                    start = time.perf_counter()
                    for linear, call in pairs:
                        call(inputs[linear.in_features])
                    times[kind].append(time.perf_counter() - start)
            w8, w4 = (statistics.median(times[kind][1:]) * 1e3 for kind in ("w8a8", "w4a8"))
            line.append(f"{how}: w8a8 {w8:8.2f} ms, w4a8 {w4:8.2f} ms ({w8 / w4:.2f}x)")
        print(f"{rows:4d} rows   " + "   ".join(line))
