"""Every use sparsegen makes of transformers' private or moving names, in one place (each tested on the oldest and
the newest transformers supported: ``make test-oldest`` and ``make test``).

- The keyword a model takes its KV cache under: ``past_key_values`` before transformers 5.24, ``cache`` since (the
  old name warns there, and goes in 5.40). Every forward sparsegen makes, and every hook that reads the cache from a
  forward's arguments, goes through ``cache_kwargs`` / ``passed_cache``.
- A model's attention implementation (``config._attn_implementation``), its modeling module's own
  ``eager_attention_forward``, and the blocks ``accelerate`` must not split (``_no_split_modules``).
"""

from __future__ import annotations

import importlib
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


def attention_implementation(model) -> str:
    """The attention implementation a model runs now (``"sdpa"``, ``"eager"``, ``"sparsegen_sdpa"``...)."""
    return model.config._attn_implementation


def model_eager_attention(module):
    """The eager attention function of the modeling module ``module`` comes from (its own: Gemma's soft-capping,
    GPT-NeoX's dtype handling, ... live there)."""
    return importlib.import_module(type(module).__module__).eager_attention_forward


def no_split_modules(model) -> list[str] | None:
    """Module classes that ``accelerate`` must keep on one device."""
    return model._no_split_modules
