"""Policy rules that are not about exactness: how a per-layer policy shares its budget, and what it allocates."""

from dataclasses import replace

import pytest
import torch

from sparsegen.kv import EvictionCache, make_policy
from sparsegen.kv.policies.pyramid import pyramid_budgets
from sparsegen.kv.policies.snapkv_layers import SnapKVLayers
from sparsegen.kv.policy import TokenView
from sparsegen.models.compat import cache_kwargs
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
            model(input_ids=ids[:, start:start + 8], **cache_kwargs(cache))
    assert cache.held_tokens() == [19, 1]
    slots = [layer.keys.shape[2] for layer in cache.layers]
    assert slots[1] < slots[0]  # storage sized by what the layer can hold, not one size for all


def test_pyramid_snapkv_shapes_its_budgets_only_when_the_last_layer_holds_its_window():
    assert [p.budget for p in _layers(make_policy("pyramid-snapkv", 40, window=2), 2)] == [78, 2]
    assert [p.budget for p in _layers(make_policy("pyramid-snapkv", 40, window=3), 2)] == [40, 40]  # SnapKV's
    # half of a 4K context over 30 layers: the last holds 102; a fifth would give it 41, below kvpress's window of 64
    layer = make_policy("pyramid-snapkv", 2048, window=64).for_layer(29, 30)
    assert (layer.name, layer.budget, layer.window, layer.attention_statistic) == ("snapkv", 102, 64, "window")
    assert make_policy("pyramid-snapkv", 819, window=64).for_layer(29, 30).budget == 819


def _layers(policy, layers):
    return [policy.for_layer(i, layers) for i in range(layers)]


def test_lagkv_scores_each_partition_once_against_the_next_and_keeps_the_recent_ones():
    """12 tokens, 2 sinks, partitions of 2: the sinks and the last partition (its next one is unseen) are kept; each
    scored partition's key and value shares sum to 2 over its held tokens, a lone survivor's to 2; the scores are
    the memo's, computed once: keys changed afterwards change nothing."""
    policy = make_policy("lagkv", 10, sinks=2)
    assert policy.describe()["lag"] == 2
    generator = torch.Generator().manual_seed(0)
    view = TokenView(index=torch.arange(12).expand(1, 1, 12), valid=torch.ones(1, 1, 12, dtype=torch.bool),
                     seen=torch.tensor([12]), attention=None, keys=torch.randn(1, 1, 12, 8, generator=generator),
                     values=torch.randn(1, 1, 12, 8, generator=generator),
                     memo=torch.full((1, 1, 12, 2), torch.nan, dtype=torch.float64))
    policy.memorize(view)
    assert view.memo[0, 0, 2:10].isfinite().all() and view.memo[0, 0, [0, 1, 10, 11]].isnan().all()
    view.keys.normal_(generator=generator)
    valid = view.valid.clone()
    valid[..., 8] = False  # partition 3 lost a token
    priority = policy.priority(replace(view, valid=valid))[0, 0]
    assert torch.isinf(priority[[0, 1, 10, 11]]).all()
    for start in (2, 4, 6):
        assert torch.isfinite(priority[start:start + 2]).all()
        assert abs(float(priority[start:start + 2].sum()) - 2) < 1e-9
    assert abs(float(priority[9]) - 2) < 1e-12


@pytest.mark.parametrize("budget, sinks, words", [(10, 10, "sinks"), (7, 4, "raise the budget")])
def test_lagkv_refuses_budgets_it_cannot_work_in(budget, sinks, words):
    with pytest.raises(ValueError, match=words):
        make_policy("lagkv", budget, sinks=sinks)


def test_tova_chooses_once_per_layer_by_every_heads_attention_unless_asked_per_head():
    """The paper's TOVA (and kvpress's): the latest query's attention summed over the layer's heads ranks every KV
    head's tokens alike; ``heads="each"`` ranks each head's by its own."""
    attention = torch.tensor([[[0.5, 0.1, 0.4], [0.0, 0.6, 0.4]]])  # [batch, kv_head, slot]
    view = TokenView(index=torch.arange(3).expand(1, 2, 3), valid=torch.ones(1, 2, 3, dtype=torch.bool),
                     seen=torch.tensor([3]), attention=attention)
    torch.testing.assert_close(make_policy("tova", 2).priority(view), torch.tensor([[[0.5, 0.7, 0.8]] * 2]))
    assert torch.equal(make_policy("tova", 2, heads="each").priority(view), attention)
    with pytest.raises(ValueError, match="heads must be one of layer, each"):
        make_policy("tova", 2, heads="kv")


def test_adakv_gives_the_layer_budget_to_the_heads_that_score_highest_and_frees_the_rest():
    """Head 0's tokens all score above head 1's: head 0 takes the shared heavy slots, head 1 keeps its recent tokens
    and its guaranteed best; the layer stores heads x budget slots, no more, and the same bytes as H2O."""
    model = tiny_model("llama")  # 2 KV heads
    policy = make_policy("adakv", 20, recent=4)  # heavy 16 per head; each head keeps at least 3 of them
    cache = EvictionCache(model, policy)
    ids = torch.randint(3, VOCAB, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
    layer = cache.layers[0]
    index = torch.arange(40).repeat(2)[None, None]  # 40 tokens of each head in one row
    head = torch.arange(2).repeat_interleave(40)[None, None]
    attention = torch.where(head == 0, 10.0 + index, 1.0 + index / 100)  # head 0's tokens always score higher
    view = TokenView(index=index, valid=torch.ones_like(index, dtype=torch.bool), seen=torch.tensor([40]),
                     attention=attention, head=head, heads=2)
    kept = layer.keep_highest(view, torch.tensor([[2 * 20]]))[0, 0]
    assert [int((kept & (head[0, 0] == h)).sum()) for h in (0, 1)] == [20 + 16 - 3, 4 + 3]
    t = layer.used
    assert t == 2 * 20 and layer.keys.shape[1] == 1
    h2o = EvictionCache(model, make_policy("h2o", 20, recent=4))
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(h2o))
    assert cache.stats()["kv_bytes_peak"] == h2o.stats()["kv_bytes_peak"]
    assert cache.held_tokens() == h2o.held_tokens() == [20, 20]


def test_adakv_refuses_rolling_positions():
    with pytest.raises(ValueError, match="positions='original'"):
        EvictionCache(tiny_model("llama"), make_policy("adakv", 10), positions="rolling")


@pytest.mark.parametrize("adaptive,rule,options",
                         [("adakv", "h2o", {"recent": 4}), ("ada-snapkv", "snapkv", {"window": 4})])
def test_ada_kv_on_a_single_kv_head_is_its_scores_rule_with_a_floor(adaptive, rule, options):
    """A model with one KV head (Gemma-3-270M) has nothing to share: Ada-KV runs its scores' rule (H2O's, SnapKV's)
    in the head's own row."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=1, intermediate_size=48)).eval()
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    caches = {name: EvictionCache(model, make_policy(name, 12, **options), chunk_size=8) for name in (adaptive, rule)}
    with torch.no_grad():
        logits = {name: model(input_ids=ids, **cache_kwargs(cache)).logits for name, cache in caches.items()}
        for _ in range(3):
            step = {name: model(input_ids=ids[:, :1], **cache_kwargs(cache)).logits for name, cache in caches.items()}
    assert caches[adaptive].layers[0].fan == 1 and caches[adaptive].held_tokens() == [12, 12]
    torch.testing.assert_close(logits[adaptive], logits[rule])
    torch.testing.assert_close(step[adaptive], step[rule])  # the floor keeps what the rule keeps anyway


def test_snapkv_layers_chooses_once_every_layer_has_attended_and_remembers_the_voting_layers_votes():
    """A prompt call's evictions wait for its end: ``share`` sees every layer holding the whole call; then each
    layer holds its budget, and every held token carries the voting layer's (the last's) head-averaged share of the
    pooled votes, the same in every layer. A decode step evicts at once and its new token has no vote yet."""
    model = tiny_model("llama")  # 2 layers
    calls = []

    class Watched(SnapKVLayers):
        def share(self, views):
            calls.append([int(view.valid[0, 0].sum()) for view in views])
            super().share(views)

    cache = EvictionCache(model, Watched(10, voters=(1.0, 1.0)))
    ids = torch.randint(3, VOCAB, (1, 29), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids[:, :28], **cache_kwargs(cache))
        assert calls == [[28, 28]] and cache.held_tokens() == [10, 10]
        memo = [layer.memo[0, :, :10, 0] for layer in cache.layers]
        by_token = [dict(zip(layer.index[0, h, :10].tolist(), memo[i][h].tolist()))
                    for i, layer in enumerate(cache.layers) for h in range(layer.index.shape[1])]
        common = set.intersection(*(set(d) for d in by_token))
        assert common and all(len({round(d[t], 12) for d in by_token}) == 1 for t in common)
        assert (memo[1] > 0).all()  # the voting layer kept tokens it voted for
        model(input_ids=ids[:, 28:], **cache_kwargs(cache))
        assert calls == [[28, 28]] and cache.held_tokens() == [10, 10]
        newest = cache.layers[0].index[0, 0, :10] == 28
        assert newest.any() and cache.layers[0].memo[0, 0, :10, 0][newest].isnan().all()
