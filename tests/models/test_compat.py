import inspect

import pytest
import torch

from sparsegen import EvictionCache, make_policy
from sparsegen.models.compat import CACHE_ARG, cache_kwargs, passed_cache
from tests.kv.families import FAMILIES, VOCAB, tiny_model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_takes_its_cache_under_the_name_sparsegen_uses(family):
    model = tiny_model(family)
    assert CACHE_ARG in inspect.signature(model.forward).parameters
    assert CACHE_ARG in inspect.signature(model.get_decoder().forward).parameters


def test_hooks_find_the_cache_under_either_name():
    cache = object()
    assert passed_cache({"cache": cache}) is cache
    assert passed_cache({"past_key_values": cache}) is cache
    assert passed_cache({"cache": None, "past_key_values": cache}) is cache
    assert passed_cache({}) is None


def test_a_forward_through_cache_kwargs_fills_the_evicting_cache():
    model = tiny_model("llama")
    cache = EvictionCache(model, make_policy("streaming", budget=8, sinks=2))
    model(input_ids=torch.randint(3, VOCAB, (1, 12)), **cache_kwargs(cache))
    assert max(cache.held_tokens()) == 8
