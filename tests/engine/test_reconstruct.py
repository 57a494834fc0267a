"""KVzip's reconstruction scoring (``sparsegen.engine.reconstruct``) against a reference written out with the model's
own eager attention: each chunk of the context read again after the whole context, every query head's attention
probabilities on the context's first tokens, the chunk and the copy, the most any paid kept per KV head."""

import pytest
import torch

from sparsegen.engine.prefill import prefill
from sparsegen.kv import EvictionCache, make_policy
from tests.kv.families import VOCAB, tiny_model

CONTEXT, CHUNK, BUDGET = 40, 16, 12


def reference_scores(model, ids: torch.Tensor, chunk: int, sinks: int = 4) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, n]``: the copy fed a chunk at a time after the context (each chunk sees the context and
    its own tokens before it); each copy query's attention renormalised over the context's first ``sinks`` tokens,
    the chunk it copies and the copy (a softmax over a subset is the whole softmax renormalised over it), and the
    most any query head paid each of those context tokens (0 for the rest)."""
    n = ids.shape[1]
    kv_heads = model.config.num_key_value_heads
    best = [torch.zeros(kv_heads, n) for _ in range(model.config.num_hidden_layers)]
    for start in range(0, n, chunk):
        piece = ids[:, start:start + chunk]
        positions = torch.cat((torch.arange(n), n + start + torch.arange(piece.shape[1])))[None]
        out = model(input_ids=torch.cat((ids, piece), dim=1), position_ids=positions, output_attentions=True)
        local = torch.zeros(n + piece.shape[1], dtype=torch.bool)
        local[:sinks] = local[start:start + chunk] = local[n:] = True
        for layer, attention in enumerate(out.attentions):
            probs = attention[0, :, n:] * local
            probs = (probs / probs.sum(-1, keepdim=True))[..., :n]
            paid = probs.reshape(kv_heads, -1, piece.shape[1], n).amax(dim=(1, 2))
            best[layer] = torch.maximum(best[layer], paid)
    return best


def reference_kept(scores: torch.Tensor, budget: int, recent: int) -> list[set[int]]:
    """Each KV head's kept ordinals: the ``recent`` newest, then the highest scores (ties: the newer)."""
    n = scores.shape[-1]
    kept = []
    for head in scores:
        protected = set(range(n - recent, n))
        others = sorted((t for t in range(n) if t not in protected), key=lambda t: (float(head[t]), t))
        kept.append(protected | set(others[len(others) - (budget - recent):]))
    return kept


@torch.inference_mode()
@pytest.mark.parametrize("recent", [0, 3])
def test_kvzip_keeps_what_the_reconstruction_attends_to_most(recent):
    ids = torch.randint(3, VOCAB, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    reference = reference_scores(tiny_model("llama", attn="eager"), ids, CHUNK)
    model = tiny_model("llama")
    cache = EvictionCache(model, make_policy("kvzip", BUDGET, recent=recent), chunk_size=CHUNK)
    prefill(model, cache, ids, torch.ones_like(ids), CHUNK, first_chunk=CONTEXT)
    assert int(cache.seen) == cache.length == CONTEXT  # the copy forgotten
    for layer, scores in zip(cache.layers, reference):
        held = [set(layer.index[0, h, :layer.used][layer.valid[0, h, :layer.used]].tolist())
                for h in range(scores.shape[0])]
        assert held == reference_kept(scores, BUDGET, recent)
        assert layer.used == BUDGET and layer.keys.shape[2] <= BUDGET + CHUNK  # (the pass's room given back)


@torch.inference_mode()
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name", ["kvzip", "kvzip-global", "expected-attention"])
def test_each_row_of_a_padded_batch_is_scored_as_if_alone(family, name):
    """Left-padded contexts of two lengths, compressed whole: each row (KVzip: reading its own tokens again) keeps
    what it keeps alone (Gemma 3's sliding-window layers their window); the logits are those of a plain prefill."""
    model = tiny_model(family)
    rows = [torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
            for length in (CONTEXT, CONTEXT - 7)]
    ids = torch.cat((rows[0], torch.cat((torch.zeros(1, 7, dtype=torch.long), rows[1]), dim=1)))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    batch = EvictionCache(model, make_policy(name, BUDGET), chunk_size=CHUNK)
    logits = prefill(model, batch, ids, mask, CHUNK)
    dense = prefill(model, EvictionCache(model, make_policy("full")), ids, mask, CHUNK)
    torch.testing.assert_close(logits, dense, rtol=1e-5, atol=1e-5)
    for row, row_ids in enumerate(rows):
        alone = EvictionCache(model, make_policy(name, BUDGET), chunk_size=CHUNK)
        prefill(model, alone, row_ids, torch.ones_like(row_ids), CHUNK)
        for ours, theirs in zip(batch.layers, alone.layers):
            assert held_by_head(ours, row) == held_by_head(theirs, 0)


def held_by_head(layer, row: int) -> set[tuple[int, int]]:
    """(KV head, token ordinal) of every token a layer holds for sequence ``row``, its heads pooled or not."""
    valid = layer.valid[row, :, :layer.used]
    heads = layer.head[row, :, :layer.used] if layer.head is not None else \
        torch.arange(valid.shape[0])[:, None].expand_as(valid)
    return set(zip(heads[valid].tolist(), layer.index[row, :, :layer.used][valid].tolist()))


@torch.inference_mode()
def test_kvzip_heads_gives_a_layers_pool_to_its_highest_scores_in_any_head():
    """The head-budget variant: a layer's ``budget × heads`` slots go to its highest reconstruction scores, whichever
    head they are in, each head's ``recent`` newest kept."""
    ids = torch.randint(3, VOCAB, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    reference = reference_scores(tiny_model("llama", attn="eager"), ids, CHUNK)
    model = tiny_model("llama")
    policy = make_policy("kvzip-heads", BUDGET)
    cache = EvictionCache(model, policy, chunk_size=CHUNK)
    prefill(model, cache, ids, torch.ones_like(ids), CHUNK, first_chunk=CONTEXT)
    for layer, scores in zip(cache.layers, reference):
        heads = scores.shape[0]
        recent = {(h, t) for h in range(heads) for t in range(CONTEXT - policy.recent, CONTEXT)}
        others = sorted(((h, t) for h in range(heads) for t in range(CONTEXT) if (h, t) not in recent),
                        key=lambda pair: (float(scores[pair]), pair[1]))
        expected = recent | set(others[len(others) - (BUDGET * heads - len(recent)):])
        valid = layer.valid[0, 0, :layer.used]
        held = set(zip(layer.head[0, 0, :layer.used][valid].tolist(), layer.index[0, 0, :layer.used][valid].tolist()))
        assert held == expected
        assert {h for h, _ in held} == set(range(heads)) and len(held) == BUDGET * heads


def sharpened(model):
    """``model`` with its second layer's queries scaled up: that layer's attention, and so its reconstruction
    scores, peaked where the first layer's are flat (layers that differ, as a trained model's do)."""
    model.model.layers[1].self_attn.q_proj.weight.data *= 20
    return model


@torch.inference_mode()
def test_kvzip_global_gives_the_models_slots_to_its_highest_scores_in_any_layer():
    """The model-wide variant: all ``budget × heads × layers`` slots go to the highest reconstruction scores of any
    layer and head (each head's ``recent`` newest kept), and each layer's budget becomes what it won."""
    ids = torch.randint(3, VOCAB, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    reference = reference_scores(sharpened(tiny_model("llama", attn="eager")), ids, CHUNK)
    model = sharpened(tiny_model("llama"))
    policy = make_policy("kvzip-global", BUDGET)
    cache = EvictionCache(model, policy, chunk_size=CHUNK)
    prefill(model, cache, ids, torch.ones_like(ids), CHUNK, first_chunk=CONTEXT)
    heads, layers = reference[0].shape[0], len(reference)
    recent = {(i, h, t) for i in range(layers) for h in range(heads) for t in range(CONTEXT - policy.recent, CONTEXT)}
    others = sorted(((i, h, t) for i in range(layers) for h in range(heads) for t in range(CONTEXT)
                     if (i, h, t) not in recent), key=lambda key: (float(reference[key[0]][key[1:]]), key[2]))
    expected = recent | set(others[len(others) - (BUDGET * heads * layers - len(recent)):])
    held = set()
    for i, layer in enumerate(cache.layers):
        valid = layer.valid[0, 0, :layer.used]
        held |= {(i, h, t) for h, t in zip(layer.head[0, 0, :layer.used][valid].tolist(),
                                            layer.index[0, 0, :layer.used][valid].tolist())}
    assert held == expected
    won = [sum(1 for key in held if key[0] == i) for i in range(layers)]
    assert won[0] != won[1] and sum(won) == BUDGET * heads * layers  # (shares that differ, the model's total)
    assert [layer.policy.budget for layer in cache.layers] == [-(-n // heads) for n in won]
    assert cache.policy.budget == BUDGET  # (the cache's own description: the budget asked for)


@torch.inference_mode()
def test_kvzip_global_within_its_budget_keeps_every_layers_budget():
    """A context the budget holds: nothing evicted, and each layer keeps the budget it had (room to decode into),
    not only what its tokens took."""
    ids = torch.randint(3, VOCAB, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    model = sharpened(tiny_model("llama"))
    cache = EvictionCache(model, make_policy("kvzip-global", CONTEXT + 8), chunk_size=CHUNK)
    prefill(model, cache, ids, torch.ones_like(ids), CHUNK, first_chunk=CONTEXT)
    assert cache.held_tokens() == [CONTEXT] * 2
    assert [layer.policy.budget for layer in cache.layers] == [CONTEXT + 8] * 2


@torch.inference_mode()
def test_only_a_fresh_eviction_cache_under_kvzip_is_read_again():
    """A transformers cache (bench's dense rows) prefills as ever; a cache that already holds tokens is not re-read."""
    from transformers import DynamicCache

    from sparsegen.engine.reconstruct import reads_whole

    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(3))
    assert not reads_whole(DynamicCache()) and not reads_whole(EvictionCache(model, make_policy("h2o", 8)))
    prefill(model, DynamicCache(), ids, torch.ones_like(ids), CHUNK)
    cache = EvictionCache(model, make_policy("kvzip", BUDGET), chunk_size=CHUNK)
    assert reads_whole(cache)
    prefill(model, cache, ids, torch.ones_like(ids), CHUNK)
    assert not reads_whole(cache)
