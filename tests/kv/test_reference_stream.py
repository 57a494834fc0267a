"""A 100k-token stream through the bundled reference model holds exactly the budget from the moment it fills."""

import pytest
import torch

import sparsegen
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.compat import cache_kwargs


@pytest.mark.heavy
def test_streaming_40k_tokens_holds_exactly_the_budget():
    model, _ = sparsegen.load("reference")
    budget, chunk, total = 256, 1000, 40_000  # 78x the trained length; the million-token run is a benchmark
    cache = EvictionCache(model, make_policy("streaming", budget), chunk_size=chunk)
    ids = torch.randint(2, model.config.vocab_size, (1, total), generator=torch.Generator().manual_seed(0))
    shapes = set()
    with torch.inference_mode():
        for start in range(0, total, chunk):
            logits = model(input_ids=ids[:, start:start + chunk], **cache_kwargs(cache), logits_to_keep=1).logits
            held = cache.held_tokens()
            assert held == [min(start + chunk, budget)] * model.config.num_hidden_layers
            shapes.add(tuple(cache.layers[0].keys.shape))
    assert torch.isfinite(logits).all()
    assert len(shapes) == 1  # the buffers never grew
    stats = cache.stats()
    assert stats["tokens_seen"] == total
    assert stats["kv_tokens_peak"] == budget + chunk
