"""Expected Attention beyond the registry-wide tests (``tests/kv/test_exactness.py`` checks its evictions call by
call against ``tests/kv/reference.py``): a context compressed whole, the queries it counts, what it refuses."""

import pytest
import torch

from sparsegen.engine.prefill import prefill
from sparsegen.kv import EvictionCache, make_policy
from tests.kv.families import VOCAB, tiny_model
from tests.kv.reference import ReferenceRun

CONTEXT, CHUNK, BUDGET = 40, 16, 12


def _held(layer, row: int = 0) -> list[set[int]]:
    return [set(layer.index[row, h, :layer.used][layer.valid[row, h, :layer.used]].tolist())
            for h in range(layer.index.shape[1])]


@torch.inference_mode()
@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_neox", "opt"])
def test_a_context_is_scored_whole_by_all_its_queries(family):
    """A prefill in chunks holds the whole context, then keeps what the reference keeps when the context comes in one
    call (every query counted before any eviction); OPT's learned positions: the queries as they are."""
    model = tiny_model(family)
    ids = torch.randint(3, VOCAB, (2, CONTEXT), generator=torch.Generator().manual_seed(5))
    policy = make_policy("expected-attention", BUDGET, future=16, sinks=2)
    cache = EvictionCache(model, policy, chunk_size=CHUNK)
    logits = prefill(model, cache, ids, torch.ones_like(ids), CHUNK)
    reference = ReferenceRun(model, [layer.policy.describe() for layer in cache.layers], rolling=False, batch=2)
    expected = reference.feed(ids, [CONTEXT])[:, -1]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    for i, layer in enumerate(cache.layers):
        for row in range(2):
            assert _held(layer, row) == [reference.kept(i, row, h) for h in range(layer.index.shape[1])]
        if not layer.is_sliding:  # each query head's count: the sinks' queries left out
            counts = layer.query_moments[..., -1, -1]
            assert counts.shape == (2, model.config.num_attention_heads) and bool((counts == CONTEXT - 2).all())


@torch.inference_mode()
def test_decode_steps_score_by_the_queries_seen_so_far():
    """After the context, each decode step's eviction counts that step's query too."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, CONTEXT + 3), generator=torch.Generator().manual_seed(6))
    cache = EvictionCache(model, make_policy("expected-attention", BUDGET, sinks=0), chunk_size=CHUNK)
    prefill(model, cache, ids[:, :CONTEXT], torch.ones_like(ids[:, :CONTEXT]), CHUNK)
    for position in range(CONTEXT, CONTEXT + 3):
        prefill(model, cache, ids[:, position:position + 1], torch.ones_like(ids[:, :1]), CHUNK, start=position)
    counts = cache.layers[0].query_moments[..., -1, -1]
    assert bool((counts == CONTEXT + 3).all()) and cache.held_tokens() == [BUDGET] * 2


def test_bad_settings_and_rolling_positions_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="use positions='original'"):
        EvictionCache(model, make_policy("expected-attention", BUDGET), positions="rolling")
    with pytest.raises(ValueError, match="future is a number of positions"):
        make_policy("expected-attention", BUDGET, future=0)
    with pytest.raises(ValueError, match="raise the budget"):
        make_policy("expected-attention", 4, sinks=4)
    assert make_policy("expected-attention", 2).sinks == 1 and make_policy("expected-attention", 64).sinks == 4
