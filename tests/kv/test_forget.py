"""Forgetting the newest tokens, one count per row (speculative decoding's rollback), leaves each row's full cache
exactly as if those tokens had never been fed."""

import pytest
import torch
from transformers import DynamicCache

from sparsegen.kv import EvictionCache, make_policy
from tests.kv.families import FAMILIES, VOCAB, tiny_model

TOL = 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_forgetting_different_counts_continue_as_if_never_fed(family):
    model = tiny_model(family)
    ids = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(0))
    forget = torch.tensor([3, 0, 5])
    cache = EvictionCache(model, make_policy("full"), rollback=8)
    with torch.no_grad():
        model(input_ids=ids[:, :12], past_key_values=cache)
        model(input_ids=ids[:, 12:], position_ids=torch.arange(12, 20).expand(3, -1), past_key_values=cache)
        cache.forget_last(forget)
        kept = 20 - forget
        after = torch.randint(3, VOCAB, (3, 2), generator=torch.Generator().manual_seed(1))
        logits = model(input_ids=after, position_ids=kept[:, None] + torch.arange(2),
                       past_key_values=cache).logits
        for row in range(3):
            alone = torch.cat([ids[row, : kept[row]], after[row]])[None]
            expected = model(input_ids=alone, past_key_values=DynamicCache(config=model.config)).logits[:, -2:]
            torch.testing.assert_close(logits[row:row + 1], expected, atol=TOL, rtol=TOL)
    assert cache.seen.tolist() == (kept + 2).tolist()


def test_forgetting_more_than_was_seen_is_refused():
    model = tiny_model("llama")
    cache = EvictionCache(model, make_policy("full"))
    with torch.no_grad():
        model(input_ids=torch.randint(3, VOCAB, (2, 6)), past_key_values=cache)
    with pytest.raises(ValueError, match="cannot forget"):
        cache.forget_last(torch.tensor([1, 7]))
    with pytest.raises(ValueError, match="cannot forget"):
        cache.forget_last(-1)
