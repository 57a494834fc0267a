"""Running a step's decoder layers a block at a time (``sparsegen.kv.regions``): outside a block step a routed layer
is the layer itself; inside one, each layer sees only its own state whatever index it asks for, and the blocks run
in order from the first layer's input. (The regional step's logits against the eager step:
tests/engine/test_step.py.)"""

import pytest
import torch

from sparsegen.engine.prefill import prefill
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.kv.regions import LayerView, block_step, route, run_block, unroute
from sparsegen.models.compat import cache_kwargs
from tests.kv.families import VOCAB, tiny_model


def test_a_routed_model_gives_its_own_logits_and_routing_twice_is_routing_once():
    model = tiny_model("gemma3")
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    before = model(ids).logits
    route(model)
    forwards = [vars(layer)["forward"] for layer in model.model.layers]
    route(model)
    assert [vars(layer)["forward"] for layer in model.model.layers] == forwards
    assert torch.equal(model(ids).logits, before)
    unroute(model)
    assert not any("forward" in vars(layer) for layer in model.model.layers)


def test_a_layer_view_answers_every_index_with_its_own_layer_and_the_rest_with_the_cache():
    model = tiny_model("llama")
    cache = EvictionCache(model, make_policy("h2o", 8))
    view = LayerView(cache, cache.layers[1])
    assert view.layer_for(0) is cache.layers[1] and cache.layer_for(0) is cache.layers[0]
    assert view.policy is cache.policy and view.layers is cache.layers


def _prefilled(model):
    cache = EvictionCache(model, make_policy("streaming", 8), chunk_size=4)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        token = prefill(model, cache, ids, torch.ones_like(ids), 4).argmax(-1)
    return cache, token[:, None]


def test_a_block_step_runs_each_block_once_from_its_first_layers_input():
    """Three layers in blocks of two: a block of two, then the last layer alone; each block gets its layers, the
    first layer's input and every layer's own arguments with the cache replaced by that layer's view; the step's
    logits are the plain forward's."""
    model = tiny_model("gemma3")
    cache, token = _prefilled(model)
    reference, _ = _prefilled(model)
    with torch.inference_mode():
        expected = model(token, **cache_kwargs(reference)).logits
    runs = []

    def run(layers, hidden, calls):
        runs.append((layers, hidden.clone(), calls))
        return run_block(layers, hidden, calls)

    with torch.inference_mode(), block_step(cache, model, 2, run) as step:
        logits = model(token, **cache_kwargs(cache)).logits
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    layers = list(model.model.layers)
    assert [blocks for blocks, _, _ in runs] == [tuple(layers[:2]), tuple(layers[2:])]
    views = [kwargs["sparsegen_cache"] for _, _, calls in runs for _, kwargs in calls]
    assert [view.layer_for(0) for view in views] == cache.layers and cache.block_step is None and not step.calls
    with torch.inference_mode():
        first = model.model.embed_tokens(token)
    torch.testing.assert_close(runs[0][1], first)


def test_a_block_step_refuses_layers_run_out_of_order():
    model = tiny_model("llama")
    cache, _ = _prefilled(model)
    with block_step(cache, model, 2, run_block) as step:
        with pytest.raises(RuntimeError, match="out of order"):
            step.forward(1, torch.zeros(1, 1, 32), (), {})
