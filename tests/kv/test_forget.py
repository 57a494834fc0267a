"""Forgetting the newest tokens, one count per row (speculative decoding's rollback), leaves each row's full cache
exactly as if those tokens had never been fed."""

import pytest
import torch
from transformers import DynamicCache

from sparsegen.kv import EvictionCache, make_policy
from sparsegen.kv.rollback import forget_last
from sparsegen.models.compat import cache_kwargs
from tests.kv.families import FAMILIES, VOCAB, tiny_model

TOL = 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_forgetting_different_counts_continue_as_if_never_fed(family):
    model = tiny_model(family)
    ids = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(0))
    forget = torch.tensor([3, 0, 5])
    cache = EvictionCache(model, make_policy("full"), rollback=8)
    with torch.no_grad():
        model(input_ids=ids[:, :12], **cache_kwargs(cache))
        model(input_ids=ids[:, 12:], position_ids=torch.arange(12, 20).expand(3, -1), **cache_kwargs(cache))
        forget_last(cache, forget)
        kept = 20 - forget
        after = torch.randint(3, VOCAB, (3, 2), generator=torch.Generator().manual_seed(1))
        logits = model(input_ids=after, position_ids=kept[:, None] + torch.arange(2),
                       **cache_kwargs(cache)).logits
        for row in range(3):
            alone = torch.cat([ids[row, : kept[row]], after[row]])[None]
            expected = model(input_ids=alone, **cache_kwargs(DynamicCache(config=model.config))).logits[:, -2:]
            torch.testing.assert_close(logits[row:row + 1], expected, atol=TOL, rtol=TOL)
    assert cache.seen.tolist() == (kept + 2).tolist()


def test_forgetting_more_than_was_seen_is_refused():
    model = tiny_model("llama")
    cache = EvictionCache(model, make_policy("full"))
    with torch.no_grad():
        model(input_ids=torch.randint(3, VOCAB, (2, 6)), **cache_kwargs(cache))
    with pytest.raises(ValueError, match="cannot forget"):
        forget_last(cache, torch.tensor([1, 7]))
    with pytest.raises(ValueError, match="cannot forget"):
        forget_last(cache, -1)


def test_a_memo_that_counted_forgotten_tokens_is_computed_again():
    """LagKV scores a partition once the next is seen whole: tokens that completed it, then were forgotten, must not
    leave their scores behind; the cache continues exactly as one that never saw them (held tokens and memo)."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 18), generator=torch.Generator().manual_seed(0))
    policy = make_policy("lagkv", 12, sinks=2)  # partitions of 2 after 2 sinks
    rolled_back, direct = EvictionCache(model, policy, rollback=2), EvictionCache(model, policy)
    with torch.no_grad():
        model(input_ids=ids[:, :10], **cache_kwargs(rolled_back))
        model(input_ids=ids[:, 10:12], **cache_kwargs(rolled_back))  # completes the partition after tokens 8-9
        forget_last(rolled_back, 2)
        model(input_ids=ids[:, 12:], position_ids=torch.arange(10, 16)[None], **cache_kwargs(rolled_back))
        model(input_ids=ids[:, :10], **cache_kwargs(direct))
        model(input_ids=ids[:, 12:], position_ids=torch.arange(10, 16)[None], **cache_kwargs(direct))
    for ours, theirs in zip(rolled_back.layers, direct.layers):
        for layer in (ours, theirs):
            order = layer.index[:, :, :layer.used].argsort(-1)
            layer.sorted = [x[:, :, :layer.used].gather(2, order if x.dim() == 3 else order[..., None].expand_as(
                x[:, :, :layer.used])) for x in (layer.index, layer.memo)]
        assert torch.equal(ours.sorted[0], theirs.sorted[0])
        torch.testing.assert_close(ours.sorted[1], theirs.sorted[1], equal_nan=True)
