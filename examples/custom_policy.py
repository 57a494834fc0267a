"""A KV policy of your own: it only scores the tokens a layer holds; the cache keeps the highest scores within the
budget and frees the rest.   python examples/custom_policy.py"""

import math

import torch

from sparsegen import cache_kwargs
from sparsegen.kv import EvictionCache, Policy, TokenView


class Strided(Policy):
    """4 sinks, the recent half of the budget, and of the older tokens every 8th."""

    name = "strided"

    def priority(self, view: TokenView) -> torch.Tensor:
        keep = view.is_sink(4) | view.is_recent(self.budget // 2)
        return torch.where(keep, math.inf, -(view.index % 8).float())


if __name__ == "__main__":
    import sparsegen

    model, tokenizer = sparsegen.load("reference")
    cache = EvictionCache(model, Strided(budget=64))
    ids = tokenizer("It was a dark and stormy night; the rain fell in torrents, except at occasional intervals, "
                    "when it was checked by a violent gust of wind which swept up the streets.", return_tensors="pt")
    out = model.generate(**ids, **cache_kwargs(cache), max_new_tokens=64, do_sample=False)
    print(tokenizer.decode(out[0, ids.input_ids.shape[1]:]))
    print("held per layer:", max(cache.held_tokens()), "of a budget of 64")
