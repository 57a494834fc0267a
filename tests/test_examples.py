"""The README's "write your own policy" example runs as a real policy: the cache holds what it scores highest."""

import importlib.util
from pathlib import Path

import torch

from sparsegen.models.cache_arg import cache_kwargs
import sparsegen
from sparsegen.kv import EvictionCache

EXAMPLE = Path(__file__).parents[1] / "examples" / "custom_policy.py"


def test_the_custom_policy_example_keeps_sinks_recent_and_every_eighth(tiny_checkpoint):
    spec = importlib.util.spec_from_file_location("custom_policy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, _ = sparsegen.load(tiny_checkpoint)
    cache = EvictionCache(model, module.Strided(budget=16))
    ids = torch.arange(2, 60)[None]
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
    kept = sorted(cache.layers[0].index[0, 0, :16].tolist())
    # 4 sinks, the 8 most recent, and the 4 newest multiples of 8 before them (ties go to the newer token)
    assert kept == [0, 1, 2, 3] + [24, 32, 40, 48] + list(range(50, 58))
