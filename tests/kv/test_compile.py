"""The decode step through an evicting cache is one graph for torch.compile: no graph break (dynamo's own count),
and the compiled step leaves the cache and the logits exactly as the eager step does (dynamo replays the cache's
Python-side updates). Compiled with dynamo only (backend "eager"): what is checked is the capture, not a kernel."""

import pytest
import torch

from sparsegen.engine.prefill import prefill
from sparsegen.engine.step import DecodeStep
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.compat import cache_kwargs
from tests.kv.families import VOCAB, named_policies, tiny_model
from tests.kv.test_host_syncs import READING, SHARED_SLOTS

STILL_READING = SHARED_SLOTS | READING


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["full", "streaming", "h2o"])
def test_a_decode_step_is_one_graph_and_compiles_to_the_eager_step(name):
    torch._dynamo.reset()
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    caches = [EvictionCache(model, make_policy(name, None if name == "full" else 10), chunk_size=8) for _ in range(3)]

    def step(cache, token, position):
        return model(input_ids=token, position_ids=position, **cache_kwargs(cache)).logits[:, -1]

    with torch.inference_mode():
        for cache in caches:
            model(input_ids=ids, **cache_kwargs(cache))
        token, position = ids[:, -1:], torch.tensor([[8]])
        explained = torch._dynamo.explain(step)(caches.pop(), token, position)  # (explaining runs the step)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        compiled = torch.compile(step, backend="eager", fullgraph=True)
        for _ in range(6):  # across the budget: the cache fills, then evicts every step
            eager, captured = step(caches[0], token, position), compiled(caches[1], token, position)
            torch.testing.assert_close(captured, eager, rtol=1e-5, atol=1e-6)
            token, position = eager.argmax(-1, keepdim=True), position + 1
    ours, theirs = caches
    assert ours.length == theirs.length and torch.equal(ours.seen, theirs.seen)
    for a, b in zip(ours.layers, theirs.layers):
        assert a.used == b.used and torch.equal(a.index[..., :a.used], b.index[..., :b.used])


def _breaks(name: str, kv_bits=None, family: str = "llama") -> int:
    """Graph breaks dynamo meets capturing the decode step ``DecodeStep(compile=True)`` runs (fixed-shape where the
    cache takes one), past the budget (evicting)."""
    model = tiny_model(family)
    cache = EvictionCache(model, make_policy(name, None if name == "full" else 10), chunk_size=8, kv_bits=kv_bits)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    step = DecodeStep(model, compile=True)
    with torch.inference_mode():
        token = prefill(model, cache, ids, torch.ones_like(ids), 8).argmax(-1)
        return step.graph_breaks(cache, token, torch.full((2,), 12))


@pytest.mark.heavy
@pytest.mark.parametrize("kv_bits", [None, 4])
@pytest.mark.parametrize("name", sorted(set(named_policies()) - STILL_READING))
def test_every_sync_free_policy_compiles_as_one_graph(name, kv_bits):
    torch._dynamo.reset()
    assert _breaks(name, kv_bits) == 0


@pytest.mark.parametrize("name", ["full", "streaming", "h2o"])
def test_float16_storage_compiles_as_one_graph(name):
    torch._dynamo.reset()
    assert _breaks(name, 16) == 0


def test_sliding_window_layers_compile_as_one_graph():
    torch._dynamo.reset()
    assert _breaks("h2o", family="gemma3") == 0


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(STILL_READING))
def test_steps_that_read_the_host_break_the_graph(name):
    """Not there yet (issue 36): Ada-KV's shared rows and LagKV's partitions are sized on the host
    (tests/kv/test_host_syncs.py): each read is a graph break."""
    torch._dynamo.reset()
    assert _breaks(name) > 0


@pytest.mark.parametrize("name", ["kvzip", "knorm"])
def test_contexts_of_nearby_lengths_held_after_compression_decode_in_one_shape(name):
    """Under ``context-once`` a compressed context stops evicting and a compiled step attends over its layers'
    allocation: contexts that kept 11 and 13 tokens get the same slots (one graph between them, not a compile
    each), and a step gives the logits of a cache holding the same tokens without the extra room."""
    model = tiny_model("llama")
    shapes, logits = [], []
    for length, budget in ((36, 11), (40, 13), (40, 13)):
        ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        cache = EvictionCache(model, make_policy(name, budget), chunk_size=16)
        with torch.inference_mode():
            prefill(model, cache, ids, torch.ones_like(ids), 16, first_chunk=length)
            if len(shapes) < 2:
                cache.stop_evicting()
            else:  # (the same held tokens, lifted without the rounding)
                cache.policy = make_policy("full")
                for layer in cache.layers:
                    layer.policy, layer.attention, layer.memo = cache.policy, None, None
            assert cache.fits_fixed_step()
            shapes.append(tuple(layer.fixed_slots for layer in cache.layers))
            token, position = ids[:, -1], torch.tensor([length])
            logits.append(DecodeStep(model, compile=False).uncompiled(cache, token, position))
    assert shapes[0] == shapes[1] != shapes[2]
    torch.testing.assert_close(logits[1], logits[2], rtol=1e-5, atol=1e-6)
