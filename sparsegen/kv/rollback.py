"""Rollback: a cache forgets its newest tokens as if they had never been fed (speculative decoding's rejected drafts).
"""

from __future__ import annotations

import torch

from sparsegen.kv.cache import EvictionCache


def forget_last(cache: EvictionCache, tokens: int | torch.Tensor) -> None:
    """Drop the newest ``tokens`` real tokens of every sequence (one count, or one per row), as if they had never
    been fed: what is left is the cache before them, less what they made it evict (and, under an attention
    policy, with the attention their queries paid still counted). Rows that forget different counts hold
    different numbers of tokens from then on, which every later call masks, as it masks padding."""
    if cache.seen is None:
        raise ValueError("cannot forget tokens of a cache that has seen none")
    counts = torch.as_tensor(tokens, device=cache.seen.device).expand_as(cache.seen)
    if bool((counts < 0).any()) or bool((counts > cache.seen).any()):
        raise ValueError(f"cannot forget {counts.tolist()} tokens of a cache whose rows have seen "
                         f"{cache.seen.tolist()}")
    if not bool(counts.any()):
        return
    if not bool((counts == counts[0]).all()):
        cache.padded = True
    cache.seen = cache.seen - counts
    for layer in cache.layers:
        if layer.is_initialized:
            t = layer.used
            kept = layer.valid[:, :, :t] & (layer.index[:, :, :t] < cache.seen[:, None, None])
            layer._compact(kept, kept.sum(-1))
            if layer.memo is not None:  # numbers that counted the forgotten tokens
                layer.memorize(cache.seen, *layer.held(layer.used))
    cache.length -= int(counts.min())  # the longest row's length, its holes counted as padding
