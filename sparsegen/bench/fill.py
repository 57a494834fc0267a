"""A cache filled as a prefill would leave it, with random keys and values: decode measured at long contexts without
the prefill (``bench --prefill synthetic``)."""

from __future__ import annotations

import torch

from sparsegen.kv.cache import EvictionCache
from sparsegen.kv.policy import TokenView


def fill_random(cache: EvictionCache, batch: int, context: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, generator: torch.Generator | None = None) -> None:
    """Put the cache where a prefill of ``context`` tokens would leave it, with random keys and values: the same
    number of held tokens per head, chosen by the policy's own rule (over random accumulated attention when it
    needs attention), so a decode step costs what it would after a real prefill. For benchmarks. (Heads that share
    slots each hold their mean share, their newest tokens: a step's cost does not depend on the split.)"""
    if cache.seen is not None:
        raise RuntimeError("fill_random needs an empty cache")
    shape = (batch, kv_heads, context)
    index = torch.arange(context, device=device).expand(shape)
    seen = torch.full((batch,), context, device=device)
    for layer in cache.layers:
        budget = layer.policy.budget
        held = context if budget is None else min(budget, context)
        policy = layer.policy
        attention = torch.rand(shape, device=device, generator=generator) if policy.needs_attention else None
        # every token's random K/V, where the policy reads them to choose; else only the held ones are drawn
        reads_kv = held < context and (policy.needs_keys or policy.needs_values or policy.memo_width > 0)
        kv = [torch.randn(*shape, head_dim, dtype=dtype, device=device, generator=generator)
              for _ in range(2)] if reads_kv else None
        memo = None
        if policy.shares_slots:
            keep = index[..., context - held:]
        elif held < context:
            if policy.memo_width:
                memo = torch.full((*shape, policy.memo_width), torch.nan, dtype=torch.float64, device=device)
            view = TokenView(index=index, valid=torch.ones(shape, dtype=torch.bool, device=device), seen=seen,
                             attention=attention, keys=kv and kv[0], values=kv and kv[1], memo=memo)
            if memo is not None:
                policy.memorize(view)
            priority = policy.priority(view).masked_fill(index < layer.pinned, torch.inf)
            keep = priority.topk(held, dim=-1).indices
        else:
            keep = index
        if kv is not None:
            keys, values = (x.gather(2, keep[..., None].expand(-1, -1, -1, head_dim)) for x in kv)
        else:
            keys, values = (torch.randn(batch, kv_heads, held, head_dim, dtype=dtype, device=device,
                                        generator=generator) for _ in range(2))
        layer.lazy_initialization(keys, values)
        kept_attention = None if layer.attention is None else attention.gather(-1, keep)
        if layer.fan > 1:  # one shared row: head h's tokens at slots h * held ...
            keys, values = (x.reshape(batch, 1, -1, head_dim) for x in (keys, values))
            keep, kept_attention = (None if x is None else x.reshape(batch, 1, -1) for x in (keep, kept_attention))
            layer.head[:, :, :keep.shape[-1]] = torch.arange(kv_heads, device=device).repeat_interleave(held)
        slots = keep.shape[-1]
        layer.store(0, slots, keys, values)
        layer.index[:, :, :slots] = keep
        layer.valid[:, :, :slots] = True
        if kept_attention is not None:  # (a history window: as if the latest query saw it all)
            target = layer.attention[:, :, :slots]
            (target if target.dim() == 3 else target[..., 0]).copy_(kept_attention)
        layer.used = layer.peak_tokens = slots
        if memo is not None:
            layer.memo[:, :, :slots] = memo.gather(2, keep[..., None].expand(-1, -1, -1, memo.shape[-1]))
        elif layer.memo is not None:
            layer.memorize(seen, *layer.held(slots))
    cache.seen, cache.length = seen, context
