"""Attention that replays per-token steps inside a layer, and attention over slots that a layer's heads share.

``stepwise_attention``: a chunk of queries under an attention policy (H2O) each sees exactly the cache one-token calls
would have left, eviction between tokens included (what streaming perplexity measures). ``shared_attention``: a
policy whose heads share one row of slots (Ada-KV), each query head seeing only its KV head's slots.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from sparsegen.kv.policy import TokenView
from sparsegen.kv.quantized import HeldCodes
from sparsegen.kv.scores import attention_scores, observe, observed_queries, scored_by_copy


def stepwise_attention(cache, layer, query, key, value, scaling: float, sliding_window: int | None = None):
    """A chunk of queries under an attention policy (H2O), each seeing exactly the cache that one-token calls would
    have left: token i attends over the tokens held after token i-1 plus itself, its attention is accumulated, and
    the lowest-priority token is evicted before token i+1 — the per-token steps replayed inside the layer, so the
    projections, MLPs and the rest of the model run once per chunk. Unpadded rows only (streams)."""
    step = cache.step
    _check_unpadded(cache)
    batch, q_heads, q, _ = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    group, start = q_heads // kv_heads, total - q
    budget = layer.policy.budget
    if cache.rolling:
        # rank order = slot order from here on, so a token's rolling position is a running count of the live
        # slots before it; keys and queries turn to it as complex pairs (one product per step, not a rotation)
        order = torch.argsort(layer.index[:, :, :start].masked_fill(~layer.valid[:, :, :start], torch.iinfo(
            torch.long).max), dim=-1, stable=True)
        # the call's keys and values in that order too (before the buffers move: they may be views of them)
        key, value = (torch.cat([x[:, :, :start].gather(2, order[..., None].expand(-1, -1, -1, x.shape[-1])),
                                 x[:, :, start:]], 2) for x in (key, value))
        for _, buf in layer.buffers():
            take = order if buf.dim() == 3 else order[..., None].expand(-1, -1, -1, buf.shape[-1])
            buf[:, :, :start] = buf[:, :, :start].gather(2, take)
        rotary = layer.rotary
        turns = rotary.turns(key, layer.keys.shape[2])
        dim = 2 * turns.shape[-1]
        raw_query = rotary.unrotate(query, step.positions, step.memo)
        key_pairs = rotary.complex_pairs(key, dim)
        query_pairs = rotary.complex_pairs(raw_query, dim).view(batch, kv_heads, group, q, dim // 2)
        logits = attention_scores(raw_query[..., dim:], key[..., dim:], scaling) if dim < key.shape[-1] else None
    else:
        logits = attention_scores(query, key, scaling)  # [B, Hkv, group, q, T]
    index = layer.index[:, :, :total]
    alive = layer.valid[:, :, :total].clone()
    alive[:, :, start:] = False
    attention = None if layer.attention is None else layer.attention[:, :, :total]
    keys_held = key if layer.policy.needs_keys else None  # as stored (unrotated under rolling positions)
    values_held = value if layer.policy.needs_values else None
    probs = query.new_zeros(batch, kv_heads, group, q, total, dtype=torch.float32)
    for i in range(q):
        alive[:, :, start + i] = True
        visible = alive
        if sliding_window is not None:
            visible = alive & (index > step.new_index[:, i, None, None] - sliding_window)
        if cache.rolling:
            ranks = visible.cumsum(-1) - 1  # invalid slots get a rank too, and are masked below
            keys = torch.view_as_real(key_pairs * turns[ranks]).flatten(-2)  # [B, Hkv, T, dim]
            here = turns[ranks[:, 0, start + i]][:, None, None]  # the query's rank: it is the newest visible token
            q_i = torch.view_as_real(query_pairs[:, :, :, i] * here).flatten(-2)  # [B, Hkv, group, dim]
            row = q_i @ keys.transpose(-1, -2) * scaling
            if logits is not None:  # dimensions the model does not rotate (partial rotary)
                row = row + logits[:, :, :, i]
        else:
            row = logits[:, :, :, i]
        p = torch.softmax(row.masked_fill(~visible[:, :, None], -torch.inf), dim=-1)
        probs[:, :, :, i] = p
        if attention is not None:
            observe(layer.policy, attention, p[:, :, :, None], visible.sum(-1)[:, :, None, None, None],
                    index=step.new_index[:, i:i + 1])
        if layer.query_moments is not None:  # the token scored by the queries before it, as a one-token call's
            if layer.memo is not None:
                end = start + i + 1
                layer.policy.memorize(TokenView(
                    index=index[:, :, :end], valid=alive[:, :, :end], seen=step.seen - (q - 1 - i), attention=None,
                    keys=key[:, :, :end], values=value[:, :, :end], memo=layer.memo[:, :, :end],
                    queries=layer.query_moments, rotary=layer.rotary, new=1))
            layer.observe_queries(query[:, :, i:i + 1], scaling, slice(i, i + 1))
        over = alive.sum(-1, keepdim=True) > budget  # at most one over, as after a decode
        if over.any():  # below the budget no policy is asked (a key-reading rule costs a pass over the held keys)
            view = TokenView(index=index, valid=alive, seen=step.seen - (q - 1 - i),
                             attention=None if attention is None else layer.observed(total),
                             keys=keys_held, values=values_held,
                             memo=None if layer.memo is None else layer.memo[:, :, :total],
                             queries=layer.query_moments, rotary=layer.rotary, new=1)
            alive = layer.drop_lowest(view, over)
    out = (probs.to(value.dtype).view(batch, kv_heads, group * q, total) @ value).view(batch, q_heads, q, -1)
    layer.pending = 0
    layer._compact(alive, alive.sum(-1))
    return out.transpose(1, 2).contiguous()


def shared_attention(cache, layer, query, key, value, scaling: float, sliding_window: int | None = None):
    """Attention over a layer whose KV heads share one row of slots (``Policy.shares_slots``): ``key``/``value`` are
    ``[B, 1, T, D]`` with each slot's head in ``layer.head``; every query head scores the row and sees only its KV
    head's slots, and the chunk's own tokens causally (the call's slot ``start + h * q + i`` is head h's token i).
    Under ``cache.stepwise`` a chunk replays per-token steps, evicting after each token as one-token calls would."""
    step = cache.step
    batch, q_heads, q, _ = query.shape
    heads, total = layer.fan, key.shape[2]
    group, start = q_heads // heads, total - heads * q
    stepwise = cache.stepwise and q > 1
    end = total if stepwise else start  # (otherwise the call's own tokens are each head's own block)
    key_index, key_head = layer.index[:, 0, :end], layer.head[:, 0, :end]  # [B, T]
    # [B, heads, q, T]: the query's KV head's real tokens up to it
    mask = (key_head[:, None, None] == torch.arange(heads, device=query.device)[:, None, None]) \
        & (key_index[:, None, None] <= step.new_index[:, None, :, None])
    if sliding_window is not None:
        mask &= step.new_index[:, None, :, None] - key_index[:, None, None] < sliding_window
    if stepwise:
        own = start + torch.arange(heads, device=query.device)[:, None] * q + torch.arange(q, device=query.device)
        logits = attention_scores(query, key, scaling).view(batch, heads, group, q, total)
        _check_unpadded(cache)
        alive = layer.valid[:, 0, :total].clone()
        alive[:, start:] = False
        probs = logits.new_zeros(logits.shape)
        for i in range(q):
            alive[:, own[:, i]] = True
            visible = mask[:, :, i] & alive[:, None]  # [B, heads, T]
            p = torch.softmax(logits[:, :, :, i].masked_fill(~visible[:, :, None], -torch.inf), dim=-1)
            probs[:, :, :, i] = p
            if layer.attention is not None:
                observe(layer.policy, layer.attention[:, :, :total], p.reshape(batch, 1, q_heads, 1, total),
                        visible.sum(-1).repeat_interleave(group, 1)[:, None, :, None, None],
                        index=step.new_index[:, i:i + 1])
            held = alive.sum(-1, keepdim=True)
            if bool((held > layer.slot_budget).any()):
                view = replace(layer.view(step.seen - (q - 1 - i)), valid=alive[:, None])
                alive = layer.keep_highest(view, held.clamp(max=layer.slot_budget))[:, 0]
        out = _attend(probs, value)
        layer.pending = 0
        layer._compact(alive[:, None], alive.sum(-1, keepdim=True))
    else:
        out = _held_and_own_blocks(layer, query, key, value, scaling, mask, sliding_window)
        layer.evict(step.seen)  # (after attention: eviction moves the slots ``value`` views)
    return out.transpose(1, 2).contiguous()


def _held_and_own_blocks(layer, query, key, value, scaling: float, held_mask: torch.Tensor,
                         sliding_window: int | None) -> torch.Tensor:
    """``shared_attention`` of one call, without scoring a query against other heads' new tokens: the call's
    tokens sit in one block per head (``start + h * q + i``), so each head's queries score the held slots
    (``held_mask``: theirs, up to them) and their own block only — a one-pass 4K context scores 4K keys per query,
    not heads × 4K (with the masks and probabilities that size, the slowest path of Ada-KV's context protocol).
    Where the policy's statistic reads only the call's last queries (``observed_queries``: ada-snapkv's window), the
    output comes from SDPA and only those queries' probabilities are formed."""
    step = layer.cache.step
    batch, q_heads, q, _ = query.shape
    heads, start = layer.fan, key.shape[2] - layer.fan * q
    group = q_heads // heads
    held_mask = held_mask & layer.valid[:, :, None, :start]  # [B, heads, q, start]
    index, real = step.new_index, step.new_valid
    own_mask = (index[:, None, :] <= index[:, :, None]) & real[:, None, :]  # [B, q, q]: query, key
    if sliding_window is not None:
        own_mask &= index[:, :, None] - index[:, None, :] < sliding_window
    own_mask |= torch.eye(q, dtype=torch.bool, device=query.device) & ~real[:, :, None]  # a pad sees its own slot
    own_keys, own_values = (x[:, 0, start:].view(batch, heads, q, -1) for x in (key, value))
    observed = observed_queries(layer.policy, q)
    if observed is None or isinstance(key, HeldCodes) or isinstance(value, HeldCodes):
        held_probs, own_probs = _block_probs(query, key[:, :, :start], own_keys, held_mask, own_mask, scaling)
        out = _attend(held_probs, value[:, :, :start]) + (
            own_probs.to(value.dtype).view(batch, heads, group * q, q) @ own_values).view(batch, q_heads, q, -1)
    else:
        # each KV head as a batch row of its own: its held slots and its block, the mask broadcast over its group
        keys, values = (torch.cat((x[:, :, :start].expand(batch, heads, start, -1), own), dim=2).flatten(0, 1)[:, None]
                        for x, own in ((key, own_keys), (value, own_values)))
        mask = torch.cat((held_mask, own_mask[:, None].expand(batch, heads, q, q)), dim=-1).flatten(0, 1)[:, None]
        out = F.scaled_dot_product_attention(query.reshape(batch * heads, group, q, -1), keys, values,
                                             attn_mask=mask, scale=scaling, enable_gqa=True)
        out = out.view(batch, q_heads, q, -1)
        held_mask, own_mask, index, real = (held_mask[:, :, -observed:], own_mask[:, -observed:],
                                            index[:, -observed:], real[:, -observed:])
        held_probs, own_probs = _block_probs(query[:, :, -observed:], key[:, :, :start], own_keys, held_mask,
                                             own_mask, scaling)
    reading = layer.cache.reading_again
    if layer.attention is not None and reading is not None:  # (KVzip's copy: scored over the sinks, its chunk, itself)
        held_mask = held_mask & scored_by_copy(layer.index[:, :, :start], reading)[:, :, None]
        held_probs, own_probs = _block_probs(query, key[:, :, :start], own_keys, held_mask, own_mask, scaling)
    if layer.attention is not None:
        rows = held_probs.shape[3]
        visible = (held_mask.sum(-1) + own_mask.sum(-1)[:, None])[:, :, None, :, None]  # [B, heads, 1, rows, 1]
        real = real[:, None, None, :, None]
        observe(layer.policy, layer.attention[:, :, :start], held_probs.reshape(batch, 1, q_heads, rows, start),
                visible.expand(-1, -1, group, -1, -1).reshape(batch, 1, q_heads, rows, 1), real, index)
        own_attention = layer.attention[:, 0, start:start + heads * q]
        observe(layer.policy, own_attention.view(batch, heads, q, *own_attention.shape[2:]), own_probs, visible,
                real, index)
    return out


def _block_probs(query, held_keys, own_keys, held_mask: torch.Tensor, own_mask: torch.Tensor,
                 scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention probabilities of ``query`` ``[B, q_heads, rows, D]`` over the held slots (one shared row,
    ``held_mask`` ``[B, heads, rows, start]``) and its head's own block (``own_keys`` ``[B, heads, q, D]``,
    ``own_mask`` ``[B, rows, q]``), one softmax over both: ``[B, heads, group, rows, start]`` and ``[..., q]``."""
    batch, q_heads, rows, _ = query.shape
    heads, start = own_keys.shape[1], held_mask.shape[-1]
    logits = torch.cat([
        attention_scores(query, held_keys, scaling).view(batch, heads, q_heads // heads, rows, start).masked_fill(
            ~held_mask[:, :, None], -torch.inf),
        attention_scores(query, own_keys, scaling).masked_fill(~own_mask[:, None, None], -torch.inf)], dim=-1)
    return torch.softmax(logits, dim=-1).split([start, own_keys.shape[2]], dim=-1)


def _check_unpadded(cache) -> None:
    if cache.padded:
        raise ValueError("stepwise eviction over a multi-token call needs unpadded rows; feed padded batches one "
                         "token per call")


def _attend(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``[B, heads, group, q, T]`` attention over one shared row of values ``[B, 1, T, D]``: ``[B, q_heads, q, D]``."""
    batch, heads, group, q, total = probs.shape
    return (probs.to(value.dtype).view(batch, 1, heads * group * q, total) @ value).view(batch, heads * group, q, -1)
