"""The compiled steps' logits beside the eager step's, teacher-forced on a real prompt: regional and whole, full and
h2o (256), 32 steps after a 400-token prompt from books/test. Usage: python scripts/compile_fidelity.py [MODEL]."""
import sys

import torch

import sparsegen
from sparsegen.data import data_dir
from sparsegen.engine.prefill import prefill
from sparsegen.engine.step import DecodeStep
from sparsegen.kv import EvictionCache, make_policy

torch.set_grad_enabled(False)
name = sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m"
model, tok = sparsegen.load(name)
text = open(data_dir() / "books" / "test" / "jane_eyre.txt").read()[30000:36000]
ids = tok(text, return_tensors="pt")["input_ids"][:, :432]
prompt, forced = ids[:, :400], ids[0, 400:]
for policy in ("full", "h2o"):
    runs = {}
    for mode in ("eager", "regional", "whole"):
        cache = EvictionCache(model, make_policy(policy, None if policy == "full" else 256))
        prefill(model, cache, prompt, torch.ones_like(prompt), 512)
        step = DecodeStep(model, compile=False if mode == "eager" else mode)
        out = []
        for t, token in enumerate(forced):
            out.append(step(cache, token[None], torch.tensor([400 + t]) + 0))
        runs[mode] = torch.cat(out)
    e = runs["eager"]
    for mode in ("regional", "whole"):
        d = (runs[mode] - e).abs().amax(-1)
        agree = (runs[mode].argmax(-1) == e.argmax(-1)).float().mean()
        print(f"{name} {policy} {mode} vs eager: max |dlogit| first {d[0]:.3f}, median {d.median():.3f}, "
              f"max {d.max():.3f}; argmax agreement {agree:.0%}", flush=True)
    d = (runs["regional"] - runs["whole"]).abs().amax(-1)
    print(f"{name} {policy} regional vs whole: max |dlogit| {d.max():.3f}; argmax agreement "
          f"{(runs['regional'].argmax(-1) == runs['whole'].argmax(-1)).float().mean():.0%}", flush=True)
