"""Eager vs torch.compile (inductor, fullgraph) of one decode step through an evicting cache, in one run: median
ms per step over 40 steps after 4, from a synthetic prefill of CONTEXT tokens (budget 1,024), and the first call's
compile time. Usage: python scripts/compile_step.py MODEL POLICY CONTEXT [WEIGHTS]. A measurement for issue 36, not
a product path yet (`bench --compile` still compiles the MLPs only)."""

import time, torch, sys
import sparsegen
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.cache_arg import cache_kwargs
from sparsegen.models.spec import kv_shape
from sparsegen.bench.syncs import HostSyncs
torch.set_num_threads(2)
name, policy, context = sys.argv[1], sys.argv[2], int(sys.argv[3])
model, _ = sparsegen.load(name)
if len(sys.argv) > 4:
    from sparsegen.quant.fast import quantize_weights
    quantize_weights(model, sys.argv[4])
_, kvh, hd = kv_shape(model.config)
def fresh():
    c = EvictionCache(model, make_policy(policy, None if policy == "full" else 1024), chunk_size=512, expected_length=context + 200)
    c.fill_random(1, context, kvh, hd, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    return c
def run(f, cache, n=40, warm=4):
    tok, pos = torch.tensor([[5]]), torch.tensor([[context]])
    ts = []
    for i in range(n + warm):
        t0 = time.perf_counter()
        tok = f(cache, tok, pos)
        if i >= warm: ts.append(time.perf_counter() - t0)
        pos = pos + 1
    ts.sort(); return ts[len(ts)//2] * 1000, tok
def step(cache, tok, pos):
    return model(input_ids=tok, position_ids=pos, **cache_kwargs(cache)).logits[:, -1].argmax(-1, keepdim=True)
with torch.inference_mode():
    e, te = run(step, fresh())
    compiled = torch.compile(step, fullgraph=True)
    t0 = time.perf_counter(); c = fresh(); tok = compiled(c, torch.tensor([[5]]), torch.tensor([[context]])); ct = time.perf_counter() - t0
    k, tk = run(compiled, fresh())
print(f"{name} {policy} {context} {sys.argv[4] if len(sys.argv)>4 else 'fp32'}: eager {e:.2f} ms, compiled {k:.2f} ms ({e/k:.2f}x), first compile {ct:.0f} s, same last token {bool((te==tk).all())}")
from torch._dynamo.utils import counters
print("graph breaks", sum(counters["graph_break"].values()), "recompiles", dict(counters["stats"]))
