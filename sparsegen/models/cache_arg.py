"""The keyword a transformers model takes its KV cache under: ``past_key_values`` before transformers 5.24,
``cache`` since (the old name warns there, and goes in 5.40). Every forward sparsegen makes, and every hook that
reads the cache from a forward's arguments, goes through here, so one checkout runs on both sides of the rename."""

from __future__ import annotations

import inspect

from transformers import LlamaModel

CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``model(..., **cache_kwargs(cache))``: hand ``cache`` to a model under this transformers' name for it."""
    return {CACHE_ARG: cache}


def passed_cache(kwargs: dict):
    """The cache a forward was called with (for hooks), under either name; ``None`` when there is none."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")
