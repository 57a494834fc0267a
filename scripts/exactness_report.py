"""Max |logit difference| of every family x policy against DynamicCache (full budget) and the slow reference.

Run from the repository root: `PYTHONPATH=. .venv/bin/python scripts/exactness_report.py`.
"""

from transformers import DynamicCache

from sparsegen.kv import EvictionCache
from tests.kv.families import FAMILIES, tiny_model
from tests.kv.reference import ReferenceRun
from tests.kv.test_exactness import CHUNKS, POLICY_NAMES, SMALL, _padded_batch, _policy, _positions, _run_chunks

worst_full, worst_small = 0.0, 0.0
for family in FAMILIES:
    for attn in ("sdpa", "eager"):
        model = tiny_model(family, attn)
        ids, mask = _padded_batch([28, 20, 13], 28)
        dense = _run_chunks(model, DynamicCache(config=model.config), ids, mask, CHUNKS)
        for name in POLICY_NAMES:
            cache = EvictionCache(model, _policy(name, 64), positions=_positions(family, name), chunk_size=8)
            diff = (_run_chunks(model, cache, ids, mask, CHUNKS) - dense)[mask.bool()].abs().max().item()
            worst_full = max(worst_full, diff)
    model = tiny_model(family)
    ids, mask = _padded_batch([28, 28], 28, seed=2)
    for name, options in SMALL.items():
        policy = _policy(name, 10, **options)
        positions = "original" if family == "opt" else None
        cache = EvictionCache(model, policy, positions=positions, chunk_size=8)
        got = _run_chunks(model, cache, ids, mask, CHUNKS)
        reference = ReferenceRun(model, policy.describe(), rolling=cache.rolling, batch=2)
        expected = reference.feed(ids, CHUNKS)
        worst_small = max(worst_small, (got - expected).abs().max().item())
print(f"families: {', '.join(FAMILIES)}")
print(f"max |logit diff| at full budget vs DynamicCache (sdpa+eager, batch 3 padded): {worst_full:.3g}")
print(f"max |logit diff| below budget vs the masked reference (batch 2): {worst_small:.3g}")
