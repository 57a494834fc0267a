"""The w4a8, w5a8 and Q8_0 kernels on AVX-512 VNNI against their AVX2 path, on a CPU that has both: each path in
processes of its own (``SPARSEGEN_KERNELS=avx2`` caps one; the path is read once a process), alternated ``--repeats``
times in one run. Per path: ms for every linear of one token of the model (its blocks' q/k/v, o, gate/up and down as
w4a8, and its tied head as Q8_0) at ROWS tokens a call, the kernels alone. The two paths' outputs are the same to
the bit (tests/quant).

    python scripts/kernel_paths_ab.py [--model smollm2|gemma3-270m] [--repeats 3] [ROWS ...]  (default 1 4)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {"smollm2": ([(576, 960), (576, 576), (576, 3072), (1536, 576)], 30, (576, 49152)),
          "gemma3-270m": ([(640, 1536), (1024, 640), (640, 4096), (2048, 640)], 18, (640, 262144))}
PATHS = {"avx512-vnni": None, "avx2": "avx2"}

CHILD = """
import json, statistics, sys, time
import torch
from sparsegen.quant import fast
torch.set_num_threads(2)
torch.manual_seed(0)
shapes, layers, (width, vocab) = json.loads(sys.argv[1])
linears = [fast.W4A8Linear(torch.nn.Linear(i, o, bias=False)) for _ in range(layers) for i, o in shapes]
codes = torch.randint(-127, 128, (vocab, width), dtype=torch.int8)
scales = (torch.rand(vocab, width // 32) * 1e-2).half()
calls = [(k.in_features, lambda x, k=k: torch.ops.sparsegen.w4a8_linear(x, k.blocks, k.out_features)) for k in linears]
calls.append((width, lambda x: torch.ops.sparsegen.q8_0_linear(x, codes, scales, vocab)))
out = {"path": fast.kernel_path()}
with torch.inference_mode():
    for rows in json.loads(sys.argv[2]):
        inputs = {w: torch.randn(rows, w) for w, _ in calls}
        times = []
        for _ in range(21):
            start = time.perf_counter()
            for w, call in calls:
                call(inputs[w])
            times.append(time.perf_counter() - start)
        out[str(rows)] = statistics.median(times[1:]) * 1e3
print(json.dumps(out))
"""


def env_for(cap: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SPARSEGEN_KERNELS"}
    if cap:
        env["SPARSEGEN_KERNELS"] = cap
    return env


def kernels_ms(model: str, rows: list[int], cap: str | None) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(SHAPES[model]), json.dumps(rows)],
                            env=env_for(cap), capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=SHAPES, default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("rows", type=int, nargs="*", default=[1, 4])
    args = parser.parse_args()
    measured = {path: [] for path in PATHS}
    for repeat in range(args.repeats):
        for path, cap in PATHS.items():
            started = time.perf_counter()
            row = kernels_ms(args.model, args.rows, cap)
            if row.pop("path") != path:
                sys.exit(f"this CPU's kernels do not take the {path} path: nothing to compare")
            measured[path].append(row)
            print(f"run {repeat + 1} {path:<12}" + "  ".join(f"{key}: {ms:.2f} ms" for key, ms in row.items())
                  + f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    print(f"\n{args.model}: median ms over {args.repeats} runs (kernels at ROWS rows: every linear of one token)")
    for key in measured["avx2"][0]:
        vnni, avx2 = (statistics.median(run[key] for run in measured[path]) for path in PATHS)
        print(f"  kernels, {key + ' rows':<15} avx512-vnni {vnni:7.2f}   avx2 {avx2:7.2f}   "
              f"avx2 / vnni {avx2 / vnni:.2f}x")


if __name__ == "__main__":
    main()
