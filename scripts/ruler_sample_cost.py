"""Seconds a RULER sample costs, with an empty cache's first pass under a [q, q] mask (as before) and without one
(plain causal attention to SDPA's ``is_causal``, a window's band a block of queries at a time: ``_first_pass_band``),
interleaved in one process, and whether the answers agree.

    PYTHONPATH=. .venv/bin/python scripts/ruler_sample_cost.py smollm2 4096 full,snapkv,streaming 0.2 query-aware 2 \
        [--weights w8a8] [--compile]

Each policy answers the same ``niah_single_1`` prompt ``repeats`` times each way (masked, banded, masked, banded...);
a row gives the fastest of each way, their ratio, whether every answer was the same, and the score.
"""

import argparse
import json
import time

import torch

import sparsegen
import sparsegen.kv.attention as attention
from sparsegen.data import data_dir
from sparsegen.eval import ruler
from sparsegen.kv import PolicySpec


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("length", type=int)
    p.add_argument("policies")
    p.add_argument("budget", type=float)
    p.add_argument("protocol")
    p.add_argument("repeats", type=int)
    p.add_argument("--weights", default="fp32")
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = sparsegen.load(args.model, weights=args.weights)
    hay = ruler.Haystack(tokenizer, (data_dir() / "books" / "test" / "great_expectations.txt").read_text())
    chat = bool(getattr(tokenizer, "chat_template", None))  # as sparsegen ruler asks: in the template, if any
    sample = ruler.make_samples(hay, "niah_single_1", args.length, 1, chat=chat)[0]
    decide = attention._first_pass_band
    rows = []
    for name in args.policies.split(","):
        runs = {"masked": [], "banded": []}
        for _ in range(args.repeats):
            for way in runs:
                attention._first_pass_band = decide if way == "banded" else (lambda *a: None)
                started = time.perf_counter()
                result = ruler.evaluate(model, tokenizer, [sample], PolicySpec.sharing(name, args.budget),
                                        args.protocol, progress=False, compile=args.compile)[0]
                runs[way].append((time.perf_counter() - started, result["answer"], result["score"]))
        attention._first_pass_band = decide
        best = {way: min(r[0] for r in runs[way]) for way in runs}
        answers = {r[1] for way in runs for r in runs[way]}
        row = {"policy": name, "masked_s": round(best["masked"], 1), "banded_s": round(best["banded"], 1),
               "ratio": round(best["masked"] / best["banded"], 2), "same_answers": len(answers) == 1,
               "score": runs["banded"][0][2]}
        rows.append(row)
        print(row, flush=True)
    print(json.dumps({"model": args.model, "length": len(sample.ids), "protocol": args.protocol,
                      "weights": args.weights, "compile": args.compile, "rows": rows}))


if __name__ == "__main__":
    main()
