"""Streaming-perplexity tokens/s per policy on one stream of Dracula (issue 16's evaluation-speed table).

    PYTHONPATH=. .venv/bin/python scripts/stream_speed.py smollm2 2048 512 full,window,streaming,h2o,streaming-h2o

Run it from two checkouts (PYTHONPATH=OTHER_TREE) for a before/after comparison on the same machine.
"""

import json
import sys

import torch

import sparsegen
from sparsegen.data import data_dir
from sparsegen.eval.stream import make_streams, stream_nll
from sparsegen.kv import make_policy


def main(model_name: str, tokens: int, budget: int, names: str) -> None:
    torch.set_num_threads(2)
    model, tokenizer = sparsegen.load(model_name)
    data = make_streams(data_dir() / "books" / "test" / "dracula.txt", tokenizer, tokens, streams=1)
    rows = {}
    for name in names.split(","):
        policy = make_policy(name, None if name == "full" else budget)
        summary = stream_nll(model, data, policy, progress=False).summary(512)
        rows[name] = {"ppl": round(summary["ppl"], 3), "tokens_per_s": summary["tokens_per_s"]}
        print(name, rows[name], flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
