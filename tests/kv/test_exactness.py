"""Eviction is exact: against transformers' DynamicCache at full budget, and against the slow reference below it."""

import pytest
import torch
from transformers import DynamicCache

from sparsegen.kv import EvictionCache, make_policy
from sparsegen.kv.rollback import forget_last
from sparsegen.kv.rows import remove_row, stack
from sparsegen.models.compat import cache_kwargs
from tests.kv.families import FAMILIES, ROPE_FAMILIES, VOCAB, named_policies, tiny_model
from tests.kv.reference import ReferenceRun

TOL = 1e-5
POLICY_NAMES = list(named_policies())  # every registered policy: a new one is tested by being registered


def _policy(name, budget, **options):
    name = name.removesuffix("-history").removesuffix("-each")  # (variants: options give the history window, TOVA's
    # choice per KV head)
    return make_policy(name, None if name == "full" else budget, **options)


def _positions(family, name):
    return "original" if family == "opt" else None


def _padded_batch(lengths, total, seed=0):
    """Left-padded random token rows and their 2D mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), total), generator=g)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, total - n:] = 1
        ids[row, : total - n] = 0
    return ids, mask


def _run_chunks(model, cache, ids, mask, chunks, after_call=None):
    """Feed ``ids`` in the given chunk lengths, with the growing mask and cumsum positions, as generate does
    (``after_call()`` after each call, if given)."""
    logits, start = [], 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        for n in chunks:
            end = start + n
            out = model(input_ids=ids[:, start:end], attention_mask=mask[:, :end],
                        position_ids=positions[:, start:end], **cache_kwargs(cache))
            logits.append(out.logits)
            if after_call is not None:
                after_call()
            start = end
    return torch.cat(logits, dim=1)


CHUNKS = [8, 8, 5] + [1] * 7  # 21 prompt tokens in three chunks, then 7 decode steps


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_budget_equals_dynamic_cache(family, name, attn):
    model = tiny_model(family, attn)
    ids, mask = _padded_batch([28, 20, 13], 28)
    expected = _run_chunks(model, DynamicCache(config=model.config), ids, mask, CHUNKS)
    # pyramid's budget is the mean per layer and its last layer holds 1/20 of it: every layer holds 28 at 20 x 64
    budget = 64 * 20 if name.startswith("pyramid") else 64
    cache = EvictionCache(model, _policy(name, budget), positions=_positions(family, name), chunk_size=8)
    got = _run_chunks(model, cache, ids, mask, CHUNKS)
    real = mask.bool()
    assert (got - expected)[real].abs().max() <= TOL
    assert cache.stats()["kv_tokens_peak"] <= 28


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "opt"])
@pytest.mark.parametrize("name", ["window", "h2o", "streaming-h2o", "adakv"])
def test_generate_with_full_budget_equals_plain_generate(family, name):
    model = tiny_model(family)
    ids, mask = _padded_batch([12, 9, 5], 12, seed=1)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    plain = model.generate(**kwargs)
    cache = EvictionCache(model, _policy(name, 64), positions=_positions(family, name))
    ours = model.generate(**kwargs, **cache_kwargs(cache))
    assert torch.equal(plain.sequences, ours.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(plain.logits, ours.logits)) <= TOL


SMALL = {"window": {}, "streaming": {"sinks": 2}, "h2o": {"recent": 4}, "streaming-h2o": {"recent": 4, "sinks": 1},
         "tova": {}, "scissorhands": {"recent": 4}, "snapkv": {},
         "knorm": {}, "keydiff": {}, "lagkv": {"sinks": 2}, "random": {}, "pyramid": {},
         "adakv": {"recent": 4}, "ada-snapkv": {"window": 2},
         "scissorhands-history": {"recent": 4, "history": 3}, "tova-each": {"heads": "each"},
         "expected-attention": {"future": 16, "sinks": 2},
         # (snapkv-layers: 2 layers at a mean of 10, 19 and 1, which holds a window of 1)
         "pyramid-snapkv": {"window": 1}, "snapkv-layers": {}}


def _rules(cache):
    """Each layer's rule as the reference reads it (sliding layers: their window; pyramid: the layer's budget)."""
    return [layer.policy.describe() for layer in cache.layers]


def _kept_by_engine(cache, layer, row, head):
    lay = cache.layers[layer]
    t = lay.used
    if lay.fan > 1:  # the heads share one row of slots
        return set(lay.index[row, 0, :t][lay.valid[row, 0, :t] & (lay.head[row, 0, :t] == head)].tolist())
    return set(lay.index[row, head, :t][lay.valid[row, head, :t]].tolist())


def _kv_heads(cache):
    return cache.layers[0].keys.shape[1] * cache.layers[0].fan


@pytest.mark.parametrize("name", list(SMALL))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_below_budget_matches_reference(family, name):
    if family == "opt" and name.startswith("streaming"):
        positions = "original"
    else:
        positions = None
    model = tiny_model(family)
    budget = 10
    policy = _policy(name, budget, **SMALL[name])
    ids, mask = _padded_batch([28, 28], 28, seed=2)
    cache = EvictionCache(model, policy, positions=positions, chunk_size=8)
    got = _run_chunks(model, cache, ids, mask, CHUNKS)
    reference = ReferenceRun(model, _rules(cache), rolling=cache.rolling, batch=2)
    expected = reference.feed(ids, CHUNKS)
    assert (got - expected).abs().max() <= TOL
    kv_heads = _kv_heads(cache)
    for layer in range(len(cache.layers)):
        for row in range(2):
            for head in range(kv_heads):
                assert _kept_by_engine(cache, layer, row, head) == reference.kept(layer, row, head)
    window = getattr(model.config, "sliding_window", None)
    sliding = [layer.is_sliding for layer in cache.layers]  # Gemma 3's sliding layers hold their window
    expected_held = [window - 1 if s else min(layer.policy.budget, 28) for s, layer in zip(sliding, cache.layers)]
    assert cache.held_tokens() == expected_held
    assert any(sliding) == (family == "gemma3")


@pytest.mark.parametrize("name", list(SMALL))
def test_padded_rows_evict_on_their_own(name):
    """A left-padded batch gives each row exactly what that sequence gives alone, fed the same real tokens."""
    model = tiny_model("llama")
    policy = lambda: _policy(name, 10, **SMALL[name])  # noqa: E731
    lengths = [28, 23, 14]
    ids, mask = _padded_batch(lengths, 28, seed=3)
    batch_cache = EvictionCache(model, policy(), chunk_size=8)
    got = _run_chunks(model, batch_cache, ids, mask, CHUNKS)
    for row, n in enumerate(lengths):
        pad = 28 - n
        alone_chunks, start = [], 0
        for c in CHUNKS:
            real = max(0, start + c - max(start, pad))
            if real:
                alone_chunks.append(real)
            start += c
        alone_ids = ids[row:row + 1, pad:]
        alone = _run_chunks(model, EvictionCache(model, policy(), chunk_size=8), alone_ids,
                            torch.ones_like(alone_ids), alone_chunks)
        assert (got[row, pad:] - alone[0]).abs().max() <= TOL


@pytest.mark.parametrize("name", ["window", "streaming", "h2o", "streaming-h2o"])
def test_memory_is_bounded_over_a_long_stream(name):
    model = tiny_model("llama")
    budget, chunk = 16, 8
    cache = EvictionCache(model, _policy(name, budget), chunk_size=chunk)
    ids = torch.randint(3, VOCAB, (2, 600))
    shapes = set()
    with torch.no_grad():
        for start in range(0, 64, chunk):  # chunked prefill
            model(input_ids=ids[:, start:start + chunk], **cache_kwargs(cache))
            assert max(cache.held_tokens()) <= budget
        for t in range(64, 600):  # decode, one token at a time
            model(input_ids=ids[:, t:t + 1], **cache_kwargs(cache))
            assert cache.held_tokens() == [budget] * 2
            shapes.add(tuple(cache.layers[0].keys.shape))
    assert shapes == {(2, 2, budget + chunk, 8)}
    stats = cache.stats()
    assert stats["kv_tokens_peak"] == budget + chunk
    assert stats["tokens_seen"] == 600


def test_bf16_keeps_fp32_scores():
    model = tiny_model("llama", dtype=torch.bfloat16)
    cache = EvictionCache(model, _policy("h2o", 8))
    ids = torch.randint(3, VOCAB, (1, 20))
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(cache)).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert cache.layers[0].attention.dtype == torch.float32
    assert cache.layers[0].keys.dtype == torch.bfloat16


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_rolling_ignores_absolute_positions(family):
    """Rolling positions are slots in the cache: shifting the positions the model is given changes nothing,
    even far past its trained length."""
    model = tiny_model(family)
    ids = torch.randint(3, VOCAB, (1, 300))
    runs = []
    for offset in (0, 5000, 3_000_000):  # at 3M the model's fp32 angles are off by up to 0.1 rad: exact here still
        cache = EvictionCache(model, _policy("streaming", 12, sinks=2), chunk_size=8)
        logits = []
        with torch.no_grad():
            for t in range(0, 300, 25):
                positions = torch.arange(t, t + 25)[None] + offset
                logits.append(model(input_ids=ids[:, t:t + 25], position_ids=positions, **cache_kwargs(cache)).logits)
        runs.append(torch.cat(logits, dim=1))
    assert (runs[0] - runs[1]).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_neox"])
@pytest.mark.parametrize("padded", [False, True])
def test_rolling_keys_held_at_their_ordinal_equal_keys_turned_every_step(family, padded):
    """Streaming under rolling positions holds keys turned to their token ordinal and turns only the query (twice:
    recent run, sinks); the older way, kept for quantized caches, holds keys unrotated and turns all of them to their
    rank every step. Both give the same logits: chunks, decode steps, left padding, past the budget."""
    model = tiny_model(family)
    lengths = [30, 22, 9] if padded else [30, 30, 30]
    ids, mask = _padded_batch(lengths, 30)
    runs = []
    for at_ordinal in (True, False):
        cache = EvictionCache(model, _policy("streaming", 12, sinks=2), chunk_size=8)
        for layer in cache.layers:
            assert layer.keys_at_index
            layer.keys_at_index = at_ordinal
        runs.append(_run_chunks(model, cache, ids, mask, [8, 8, 6] + [1] * 8))
    assert (runs[0] - runs[1]).abs().max() <= TOL


@pytest.mark.parametrize("padded", [False, True])
def test_rolling_sinks_take_their_own_frame_once_a_row_may_evict(padded):
    """Until a row may hold more than the budget every rank is its ordinal, and the query is turned once, not once
    more for the sinks (``may_evict``, set before the call that may evict, then kept). The logits equal those of a
    cache that turns it twice from the first token, through chunks and decode steps past the budget; a cache that
    never turned it twice gives others once a token is evicted."""
    model = tiny_model("llama")
    ids, mask = _padded_batch([30, 22, 9] if padded else [30] * 3, 30)
    chunks = [8, 4] + [1] * 18
    runs = {}
    for frames in ("marked", "always", "never"):
        cache = EvictionCache(model, _policy("streaming", 12, sinks=2), chunk_size=8)
        if frames == "always":
            for layer in cache.layers:
                layer.may_evict = True
        if frames == "never":
            cache.mark_evicting = lambda length: None
        marks = []
        logits = _run_chunks(model, cache, ids, mask, chunks, lambda: marks.append(cache.layers[0].may_evict))
        runs[frames] = logits, marks
    logits, marks = runs["marked"]
    assert marks == [False, False] + [True] * 18  # 12 tokens fit the budget; the 13th may evict
    assert (logits - runs["always"][0]).abs().max() <= TOL
    assert (logits[:, :13] - runs["never"][0][:, :13]).abs().max() <= TOL
    assert (logits[:, 13:] - runs["never"][0][:, 13:]).abs().max() > 10 * TOL


def test_an_announced_length_past_the_budget_takes_the_sinks_frame_from_the_start():
    """A caller that announces more tokens than the budget gets the two frames at once: a compiled step then has
    one graph, not a second at the step the budget is passed. Caches without rolling sinks are never marked (a mark
    would change their compiled step's state for nothing)."""
    model = tiny_model("llama")

    def marked(name, length):
        return [layer.may_evict for layer in EvictionCache(model, _policy(name, 12), expected_length=length).layers]

    assert all(marked("streaming", 13)) and not any(marked("streaming", 12))
    assert not any(marked("full", 100) + marked("h2o", 100) + marked("window", 100))


def test_a_stacked_row_that_evicted_keeps_the_sinks_frame():
    """A row that evicted and then forgot tokens (a speculative rollback) holds no more than its budget, but its
    ranks are no longer its ordinals: the stacked batch it joins keeps both frames, and so does every cache a row of
    that batch goes back to."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        caches = [EvictionCache(model, _policy("streaming", 12, sinks=2), chunk_size=16) for _ in range(2)]
        model(input_ids=ids[:1, :16], **cache_kwargs(caches[0]))
        forget_last(caches[0], 5)  # 11 tokens fed, after an eviction
        model(input_ids=ids[1:, :4], **cache_kwargs(caches[1]))
        assert caches[0].layers[0].may_evict and caches[0].length == 11 and not caches[1].layers[0].may_evict
        alone = EvictionCache(model, _policy("streaming", 12, sinks=2), chunk_size=16)
        model(input_ids=ids[:1, :16], **cache_kwargs(alone))
        forget_last(alone, 5)
        batch = stack(model, caches)
        assert all(layer.may_evict for layer in batch.layers)
        token = ids[:, 11:12].clone()
        token[1] = ids[1, 4]
        position = torch.tensor([[11], [4]])
        got = model(input_ids=token, position_ids=position, **cache_kwargs(batch)).logits[0]
        expected = model(input_ids=token[:1], position_ids=position[:1], **cache_kwargs(alone)).logits[0]
        assert (got - expected).abs().max() <= TOL
        remove_row(batch, 1, caches[1], 1)  # (the batch cannot tell which of its rows evicted)
        assert all(layer.may_evict for layer in caches[1].layers)


def test_rolling_keys_turned_every_step_where_held_otherwise():
    """Quantized K/V (keys quantized unrotated) and attention policies (no single recent run) keep the older way."""
    model = tiny_model("llama")
    assert not any(layer.keys_at_index for layer in EvictionCache(model, _policy("streaming", 12), kv_bits=8).layers)
    assert not any(layer.keys_at_index for layer in EvictionCache(model, _policy("streaming-h2o", 12)).layers)
    assert not any(layer.keys_at_index for layer in EvictionCache(model, _policy("streaming", 12),
                                                                  positions="original").layers)


@pytest.mark.parametrize("name", ["full", "window", "h2o"])
def test_sliding_window_layers_match_dynamic_cache(name):
    """Models with sliding-window attention (e.g. Mistral v0.1, Phi-3) keep their window under eviction."""
    from transformers import MistralConfig, MistralForCausalLM

    from tests.kv.families import _gqa

    torch.manual_seed(0)
    model = MistralForCausalLM._from_config(MistralConfig(**_gqa(sliding_window=6)), attn_implementation="sdpa").eval()
    ids, mask = _padded_batch([28, 28], 28, seed=4)
    expected = _run_chunks(model, DynamicCache(config=model.config), ids, mask, CHUNKS)
    got = _run_chunks(model, EvictionCache(model, _policy(name, 64), chunk_size=8), ids, mask, CHUNKS)
    assert (got - expected).abs().max() <= TOL
    model.config.sliding_window = None
    unwindowed = _run_chunks(model, DynamicCache(config=model.config), ids, mask, CHUNKS)
    assert (expected - unwindowed).abs().max() > 1e-3  # the window really restricted attention


@pytest.mark.parametrize("positions", ["original", "rolling"])
@pytest.mark.parametrize("name, options", [("window", {}), ("streaming", {"sinks": 3})])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_order_policies_compute_chunks_as_if_token_by_token(family, name, options, positions):
    """Window and streaming give each query of a chunk exactly its own window: chunked == one token at a time."""
    if family == "opt" and positions == "rolling":
        pytest.skip("OPT has no RoPE")
    model = tiny_model(family)
    ids, mask = _padded_batch([60, 47], 60, seed=5)
    one_by_one = _run_chunks(model, EvictionCache(model, _policy(name, 12, **options), positions=positions),
                             ids, mask, [1] * 60)
    chunked = _run_chunks(model, EvictionCache(model, _policy(name, 12, **options), positions=positions,
                                               chunk_size=16), ids, mask, [16, 16, 16, 5, 7])
    assert (chunked - one_by_one)[mask.bool()].abs().max() <= TOL


@pytest.mark.parametrize("name", ["h2o", "streaming-h2o", "tova", "scissorhands", "snapkv", "knorm", "keydiff", "lagkv",
                                  "random", "pyramid", "pyramid-snapkv", "adakv", "ada-snapkv",
                                  "scissorhands-history", "tova-each", "expected-attention"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_stepwise_chunks_equal_one_token_per_call(family, name):
    """Under ``stepwise`` a chunk of tokens gets exactly what feeding them one per call gives (the reference fed
    token by token): H2O's evictions between tokens replayed inside each layer."""
    positions = "original" if family == "opt" else None
    model = tiny_model(family)
    policy = _policy(name, 10, **SMALL[name])
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    cache = EvictionCache(model, policy, positions=positions, chunk_size=16, stepwise=True)
    got = _run_chunks(model, cache, ids, torch.ones_like(ids), [16, 16, 5, 3])
    reference = ReferenceRun(model, _rules(cache), rolling=cache.rolling, batch=2)
    expected = reference.feed(ids, [1] * 40)
    assert (got - expected).abs().max() <= TOL
    for layer in range(len(cache.layers)):
        for row in range(2):
            for head in range(_kv_heads(cache)):
                assert _kept_by_engine(cache, layer, row, head) == reference.kept(layer, row, head)


def test_stepwise_refuses_padded_chunks():
    model = tiny_model("llama")
    cache = EvictionCache(model, _policy("h2o", 10), chunk_size=8, stepwise=True)
    ids, mask = _padded_batch([20, 14], 20)
    with pytest.raises(ValueError, match="unpadded rows"):
        _run_chunks(model, cache, ids, mask, [8, 8, 4])
