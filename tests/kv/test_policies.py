"""Policy rules that are not about exactness: how a per-layer policy shares its budget, and what it allocates."""

import torch

from sparsegen.kv import EvictionCache, make_policy
from sparsegen.kv.policies.pyramid import pyramid_budgets
from tests.kv.families import VOCAB, tiny_model


def test_pyramid_budgets_fall_with_depth_and_keep_the_total():
    budgets = pyramid_budgets(512, 30)
    assert budgets == sorted(budgets, reverse=True) and sum(budgets) == 30 * 512
    assert budgets[-1] == round(512 / 20) and budgets[0] > 1.9 * 512
    assert pyramid_budgets(7, 1) == [7] and all(b >= 1 for b in pyramid_budgets(3, 12))


def test_each_pyramid_layer_holds_and_allocates_its_own_budget():
    model = tiny_model("llama")  # 2 layers: budgets 19 and 1 for a mean of 10
    cache = EvictionCache(model, make_policy("pyramid", 10), chunk_size=8)
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for start in range(0, 40, 8):
            model(input_ids=ids[:, start:start + 8], past_key_values=cache)
    assert cache.held_tokens() == [19, 1]
    slots = [layer.keys.shape[2] for layer in cache.layers]
    assert slots[1] < slots[0]  # storage sized by what the layer can hold, not one size for all
