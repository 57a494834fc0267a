"""Hooking a Hugging Face model so an ``EvictionCache`` can evict: attention function and step hook.

``prepare(model)`` switches the model to the attention implementation ``sparsegen_sdpa`` or
``sparsegen_eager`` (registered with transformers' ``AttentionInterface``). With any other cache these
call transformers' own ``sdpa``/``eager`` code unchanged; with an ``EvictionCache`` they attend over the
held tokens, accumulate attention scores when the policy needs them (always fp32, computed from q and the
cached k, so no backend has to return weights), and then let the cache evict. A forward pre-hook on the
decoder tells the cache what each call brings (padding, positions) before any layer runs, and adds the cache to
the call's keyword arguments, which transformers passes on to every layer's attention function: no global state.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from sparsegen.kv import native_attention
from sparsegen.kv.quantized import HeldCodes
from sparsegen.kv.regions import CACHE_KWARG, route, unroute
from sparsegen.kv.rotary import memoized
from sparsegen.kv.scores import attention_scores, observe, observed_queries, scored_by_copy, slot_ranks
from sparsegen.kv.stepwise import shared_attention, stepwise_attention
from sparsegen.models.compat import attention_implementation, model_eager_attention, passed_cache
from sparsegen.models.families import family

BACKENDS = ("sdpa", "eager")
FEW_QUERIES = native_attention.MOST_QUERIES  # up to a speculative verification: the pending token and 16 drafts
# a long call's queries per pass of ``_grouped_attention``: each block's scores stay in cache and read only the keys
# its queries can see (a causal one-pass 4K prefill, one SmolLM2 layer's 9 heads: 1.39 s whole, 0.69 s in blocks of
# 512, 0.43 s in blocks of 256, measured)
QUERY_BLOCK = 256
# and at most this many fp32 scores a block (8 MB, all heads): a block's [rows, T] scores written and read back while
# they are in cache. SmolLM2's one-pass 4K prefill under H2O: 14.7 s in blocks of 256 queries, 11.8 s in blocks of
# 57 (scripts/compression_cost.py)
SCORES_PER_BLOCK = 1 << 21


def eviction_attention(cache, layer, query, key, value, scaling: float, sliding_window: int | None = None):
    """Attention of the new queries over the held + new tokens of one layer, then eviction.

    For policies whose kept set depends only on token order (``Policy.query_view``), every query of a
    chunk sees exactly the tokens it would see if the chunk were fed one token at a time, positions
    included; other policies (H2O) let the chunk's queries see the held tokens and the chunk, causally.
    """
    if key.dtype != query.dtype and not isinstance(key, HeldCodes) and not _native_decode(cache, layer, query):
        key, value = key.to(query.dtype), value.to(query.dtype)  # float16-held K/V (kv_bits=16), widened
    if layer.fan > 1:
        return shared_attention(cache, layer, query, key, value, scaling, sliding_window)
    if cache.stepwise and query.shape[2] > 1 and layer.policy.budget is not None and layer.policy.query_view() is None:
        return stepwise_attention(cache, layer, query, key, value, scaling, sliding_window)
    if layer.query_moments is not None:
        layer.observe_queries(query, scaling)
    step = cache.step
    q = query.shape[2]
    # a few queries per sequence (a decode step, a speculative verification) on a CPU in fp32: grouped matmuls beat
    # SDPA, whose CPU kernel is built for many queries (measured in docs/benchmarks-log.md)
    few_queries_on_cpu = q <= FEW_QUERIES and query.device.type == "cpu" and query.dtype == torch.float32
    # a decode step's own K/V (over a full budget, or fixed-shape) wait beside the held slots
    # (``EvictionLayer.incoming``): grouped matmuls read both; where one tensor is needed (SDPA, keys turned to their
    # ranks), they are joined (a copy)
    incoming = layer.incoming
    if incoming is not None and not (few_queries_on_cpu and (layer.keys_at_index or not cache.rolling)):
        key, value = torch.cat((key, incoming[0]), dim=2), torch.cat((value, incoming[1]), dim=2)
        incoming = None
    total = key.shape[2] + (q if incoming is not None else 0)
    view = layer.query_view()
    mask, query_slot, band = _visibility(cache, layer, q, total, view, sliding_window)
    causal = band is not None and band[1] >= q - 1
    if band is not None and not causal and (layer.policy.needs_attention or few_queries_on_cpu
                                            or isinstance(key, HeldCodes) or view is None):
        mask = _band_mask(0, q, total, band, query.device)  # only SDPA takes the band a block at a time
        band = None
    value_dim = value.shape[-1]
    sink_query = sink_slot = None
    if layer.keys_at_index:
        query, sink_query, sink_slot = _index_frame_queries(cache, layer, query, total, query_slot)
        if sink_query is not None and not few_queries_on_cpu:  # SDPA: the two frames side by side, one product
            query, key, value = _side_by_side(query, sink_query, key, key, value, sink_slot[:, :, 0, :, None])
            sink_query = None
    elif cache.rolling and view is not None and q > 1:
        query, key, value = _rolling_chunk_frames(cache, layer, query, key, value, total, view, query_slot)
    elif cache.rolling:
        query, key = _rank_frames(cache, layer, query, key, total, view)
    observed = observed_queries(layer.policy, q)
    if (cache.reading_again is not None and layer.attention is not None and sink_query is None and incoming is None
            and not isinstance(key, HeldCodes) and layer.attention.dim() == 3):
        out = _reconstruction_attention(cache, layer, query, key, value, mask, scaling, band)
    elif (observed is not None and sink_query is None and incoming is None and not isinstance(key, HeldCodes)
            and (mask is None or mask.shape[1] == 1)):
        out = _attention_observing_last(cache, layer, query, key, value, mask, scaling, observed, band)
    elif layer.policy.needs_attention or (sliding_window is not None and view is None) or few_queries_on_cpu:
        if band is not None:
            mask = _band_mask(0, q, total, band, query.device)
        out = _grouped_attention(cache, layer, query, sink_query, sink_slot, key, value, incoming, mask, scaling)
    elif band is not None and not causal:
        out = _banded_attention(query, key, value, band, scaling)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=scaling,
                                             enable_gqa=True)
    layer.evict(step.seen)
    return out[..., :value_dim].transpose(1, 2).contiguous()


def _native_decode(cache, layer, query) -> bool:
    """Whether this call's attention is ``sparsegen::decode_attention``'s (which reads float16-held K/V as they are):
    a CPU decode step in fp32, one row of slots per KV head, keys that need no turning to their ranks."""
    return (cache.native_decode and query.shape[2] == 1 and query.dtype == torch.float32 and layer.fan == 1
            and (layer.keys_at_index or not cache.rolling))


def _visibility(cache, layer, q: int, total: int, view, sliding_window: int | None):
    """Which of the ``total`` slots each query sees, ``[B, 1 or Hkv, q, T]`` (None: all of them, a decode step of
    rows never padded, not fixed-shape, where every held slot is real and an order policy kept its window), under
    rolling positions each query's rank among them ``[B, 1, q]`` (None where the mask is), and the mask's
    ``(sinks, reach)`` where ``_first_pass_band`` gives them (the mask then None, never built: a [q, q] mask over an
    8K prompt is 64M entries a layer)."""
    step, device = cache.step, layer.valid.device
    valid = layer.valid[:, :, :total]  # [B, Hkv, T]; the same for every head
    band = _first_pass_band(cache, q, total, view, sliding_window)
    if band is not None and (band[1] >= q - 1 or not cache.rolling):
        rank = torch.arange(q, device=device).expand(valid.shape[0], 1, q) if cache.rolling else None
        return None, rank, band
    key_index = layer.index[:, :, None, :total]  # [B, Hkv, 1, T]
    query_index = step.new_index[:, None, :, None]  # [B, 1, q, 1]
    mask = query_slot = None
    if q > 1 or cache.padded:
        start = total - q
        slot = torch.arange(total, device=device)
        row = torch.arange(q, device=device)
        causal = (slot[None, :] < start) | (slot[None, :] - start <= row[:, None])  # [q, T]
        mask = valid[:, :1, None, :] & causal  # [B, 1, q, T]
        if view is not None and q > 1:
            sinks, recent = view
            mask = mask & ((key_index[:, :1] >= query_index - recent) | (key_index[:, :1] < sinks))
        if cache.rolling:
            query_slot = (mask.sum(-1) - 1).clamp(min=0)  # [B, 1, q]: the rolling position of each query
        mask = mask | (slot[None, :] == (start + row)[:, None]) & ~step.new_valid[:, None, :, None]  # pads: themselves
    elif cache.fixed_step:  # the layer's fixed slots, some perhaps free (every head holds as many)
        mask = valid[:, :1, None, :]
    if sliding_window is not None:
        # an order policy holds the same tokens in every head: one mask for all, which SDPA takes
        in_window = query_index - (key_index if view is None else key_index[:, :1]) < sliding_window
        mask = in_window if mask is None else mask & in_window
    return mask, query_slot, None


def _first_pass_band(cache, q: int, total: int, view, sliding_window: int | None) -> tuple[int, int] | None:
    """``(sinks, reach)``: in an empty cache's first pass, every token real, each query sees the ``reach`` tokens
    before it and the first ``sinks`` (an order policy's, or a sliding-window layer's, view). None where a mask must
    say (held tokens, padding, one query, a sliding window that hides some of a policy's sinks). A ``reach`` of every
    token is plain causal: left to SDPA's ``is_causal``, whose CPU kernel skips the blocks above the diagonal instead
    of reading a mask (the same output, without building or reading the mask)."""
    if q <= 1 or total != q or cache.padded:
        return None
    sinks, reach = (0, q - 1) if view is None else (view[0], min(view[1], q - 1))
    if sliding_window is not None and sliding_window - 1 < reach:  # the window hides what the view shows
        return 0, sliding_window - 1
    if sliding_window is not None and sinks and sliding_window - 1 < q - 1:  # and the sinks behind it
        return None
    return sinks, reach


def _band_mask(first: int, rows: int, total: int, band: tuple[int, int], device: torch.device) -> torch.Tensor:
    """The first pass's mask (``_first_pass_band``), rows ``first .. first + rows`` over ``total`` slots,
    ``[1, 1, rows, T]``."""
    queries = torch.arange(first, first + rows, device=device)
    return _band_rows(queries, torch.arange(total, device=device), band)[None, None]


def _band_rows(rows: torch.Tensor, slots: torch.Tensor, band: tuple[int, int]) -> torch.Tensor:
    """Which of ``slots`` (token ordinals) each query of ``rows`` sees under ``band``, ``[rows, slots]``."""
    sinks, reach = band
    rows = rows[:, None]
    return (slots <= rows) & ((slots >= rows - reach) | (slots < sinks))


def _banded_attention(query, key, value, band: tuple[int, int], scaling: float) -> torch.Tensor:
    """SDPA of a first pass whose queries see only the ``reach`` tokens before them (and the first ``sinks``), a
    block of queries at a time over the keys the block sees: Gemma 3's sliding-window layers over an 8K prompt read
    at most 767 keys a block of 256 queries instead of 8K under a [8K, 8K] mask."""
    sinks, reach = band
    q, outs = query.shape[2], []
    for start in range(0, q, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, q)
        first = max(start - reach, 0)
        slots = torch.cat((torch.arange(min(sinks, first)), torch.arange(first, end))).to(query.device)
        mask = _band_rows(torch.arange(start, end, device=query.device), slots, band)
        outs.append(F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, slots], value[:, :, slots],
                                                   attn_mask=mask, scale=scaling, enable_gqa=True))
    return torch.cat(outs, dim=2)


def _index_frame_queries(cache, layer, query, total: int, query_slot: torch.Tensor | None):
    """Keys held turned to their token ordinal (``EvictionLayer.keys_at_index``): a query turned to its own ordinal
    sees every recent key at its rolling distance already; the sinks (rank = ordinal) need the query at its rolling
    rank instead. The query in both frames (the second None without sinks, or while no row may have evicted: each rank
    is then the ordinal) and which slots are sinks ``[B, 1, 1, T]``.
    An order policy's held count, so each query's rank, follows from its sinks and budget alone: one turn a step."""
    step, rotary = cache.step, layer.rotary
    at_index = rotary.turn(query, step.positions, step.new_index[:, None, :], step.memo)
    if not layer.sinks or not layer.may_evict:
        return at_index, None, None
    rank = layer.valid[:, :1, :total].sum(-1, keepdim=True) - 1 if query_slot is None else query_slot  # [B, 1, q]
    at_rank = rotary.turn(query, step.positions, rank, step.memo, (layer.sinks, layer.policy.budget))
    sink_slots = memoized(step.memo, ("sink slots", total, layer.sinks, layer.index.shape),  # (alike in every layer)
                          lambda: layer.index[:, :1, None, :total] < layer.sinks)
    return at_index, at_rank, sink_slots


def _side_by_side(query, sink_query, near_key, far_key, value, sink_slot: torch.Tensor):
    """Two position frames in one attention product: query = [q_near, q_far], a recent key = [k_near, 0], a sink key
    = [0, k_far] (``sink_slot`` ``[B, 1, T, 1]``), values padded to the same width (equal q/k/v widths keep SDPA on
    its fused kernel), so one fused call computes every query's logits in its own frame."""
    query = torch.cat((query, sink_query), dim=-1)
    key = torch.cat((near_key.masked_fill(sink_slot, 0), far_key.masked_fill(~sink_slot, 0)), dim=-1)
    return query, key, F.pad(value, (0, key.shape[-1] - value.shape[-1]))


def _rolling_chunk_frames(cache, layer, query, key, value, total: int, view: tuple[int, int], query_slot):
    """Un-rotated keys of an order policy under a chunk (rolling positions): each query's own rolling positions,
    recent keys at their distance in the stream, sinks at slots 0..sinks-1 and the query at (tokens it sees - 1);
    positions measured from a base near the chunk, both frames side by side. The recent keys a query sees lie within
    ``total`` tokens before the chunk, so every position is under ``bound`` (sinks' near and others' far positions
    are masked out: clamped) and the angles come from a table."""
    step, rotary = cache.step, layer.rotary
    sinks, recent = view
    bound = total + query.shape[2] + 2
    raw_query = rotary.unrotate(query, step.positions, step.memo)
    base = step.new_index.min(-1).values - min(recent, total) - 1
    index = layer.index[:, :, :total]
    query = rotary.rotate(raw_query, (step.new_index - base[:, None])[:, None, :], bound=bound)
    near_key = rotary.rotate(key, (index - base[:, None, None]).clamp(0, bound - 1), bound=bound)
    if not sinks:
        return query, near_key, value
    far_key = rotary.rotate(key, index.clamp(0, bound - 1), bound=bound)
    sink_query = rotary.rotate(raw_query, query_slot, bound=bound)
    return _side_by_side(query, sink_query, near_key, far_key, value, (index[:, :1] < sinks)[..., None])


def _rank_frames(cache, layer, query, key, total: int, view):
    """Un-rotated keys under rolling positions, one token a row (or a chunk of a policy with no order view): every
    held key and each query turned to its rank among the held tokens."""
    step = cache.step
    rotary, bound = layer.rotary, layer.keys.shape[2]
    valid = layer.valid[:, :, :total]

    def rank_angles():
        held_before = valid[:, 0, :total - query.shape[2]].sum(-1)
        query_slots = (held_before[:, None] + step.new_valid.long().cumsum(-1) - 1).clamp(min=0)
        if view is not None:  # every head holds the same tokens
            ranks = slot_ranks(layer.index[:, :1, :total], valid[:, :1], sinks=view[0])
        else:
            ranks = slot_ranks(layer.index[:, :, :total], valid)
        return rotary.cos_sin(key, ranks, bound), rotary.cos_sin(query, query_slots[:, None, :], bound)

    # an order policy lays out every layer's slots alike: one computation per step serves all layers that
    # share the policy and the rotary embedding
    key_angles, query_angles = memoized(step.memo if view is not None else None, ("ranks", total, view, id(rotary)),
                                        rank_angles)
    key = rotary.rotate(key, None, angles=key_angles, out=cache.workspace(key.shape, key))
    query = rotary.rotate(rotary.unrotate(query, step.positions, step.memo), None, angles=query_angles)
    return query, key


def _attention_observing_last(cache, layer, query, key, value, mask, scaling: float, observed: int,
                              band: tuple[int, int] | None):
    """A long call's attention by SDPA, and the probabilities of its last ``observed`` queries alone, all that the
    policy's statistic reads: a one-pass 4K prefill under SnapKV no longer writes every head's [4K, 4K] scores
    (the same kept tokens as ``_grouped_attention``, which computes each of these rows the same way)."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=band is not None,
                                         scale=scaling, enable_gqa=True)
    step, total = cache.step, key.shape[2]
    scores = attention_scores(query[:, :, -observed:], key, scaling)
    last = _band_mask(total - observed, observed, total, band, key.device) if band is not None else mask
    if last is not None:
        scores.masked_fill_(~last[:, :, None, -observed:], -torch.inf)
    real = step.new_valid[:, None, None, -observed:, None]
    observe(layer.policy, layer.attention[:, :, :total], torch.softmax(scores, dim=-1), total, real, step.new_index)
    return out


def _reconstruction_attention(cache, layer, query, key, value, mask: torch.Tensor | None, scaling: float,
                              band: tuple[int, int] | None) -> torch.Tensor:
    """A chunk of KVzip's copy (``cache.reading_again``: the ordinals of the context's tokens it copies): its hidden
    states attend to everything held and to the copy before them (SDPA, no probabilities); its scores are each copy
    query's softmax over the context's first ``RECONSTRUCTION_SINKS`` tokens, the chunk it copies and the copy so far
    (KVzip's own normalisation, kvpress's too), and each of those tokens keeps the most any query head pays it. (Until
    2026-12-05 the softmax was over the whole context: within noise the same needles kept on RULER, and the same
    cost, docs/results/smollm2/ruler/README.md.)"""
    q, total = query.shape[2], key.shape[2]
    held = total - q
    if band is not None:
        mask = _band_mask(0, q, total, band, query.device)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    local = layer.valid[:, :, :held] & scored_by_copy(layer.index[:, :, :held], cache.reading_again)  # [B, Hkv, held]
    columns = local.any(dim=(0, 1)).nonzero().squeeze(1)  # (one host read a layer: a prefill's, never a step's)
    scores = attention_scores(query, torch.cat((key.index_select(2, columns), key[:, :, held:]), dim=2), scaling)
    seen = torch.cat((local.index_select(2, columns)[:, :, None, :].expand(-1, -1, q, -1),
                      torch.ones(q, q, dtype=torch.bool, device=query.device).tril().expand(*local.shape[:2], q, q)),
                     dim=-1)  # [B, Hkv, q, L + q]
    if mask is not None:  # (padded rows: what each query may see at all)
        seen = seen & torch.cat((mask.index_select(-1, columns), mask[..., held:]), dim=-1)
    probs = torch.softmax(scores.masked_fill(~seen[:, :, None], -torch.inf), dim=-1)[..., :len(columns)]
    real = cache.step.new_valid[:, None, None, :, None]  # (a pad's query pays nothing)
    paid = probs.masked_fill(~real, 0).nan_to_num(0).amax(dim=(2, 3))  # [B, Hkv, L]
    layer.attention[:, :, columns] = torch.maximum(layer.attention[:, :, columns], paid)
    return out


def _grouped_attention(cache, layer, query, sink_query, sink_slot, key, value, incoming, mask, scaling: float):
    """Attention by grouped matmuls, fp32 scores: what a policy that observes attention needs, and what one or a few
    queries run fastest on a CPU. ``sink_query``: the query in the sinks' frame (``sink_slot`` ``[B, 1, 1, T]``),
    both frames scored in one pass over the keys; ``incoming``: the new token's K/V, beside ``key``/``value``."""
    batch, q_heads, q, _ = query.shape
    held = key.shape[2]
    total = held + (q if incoming is not None else 0)
    if cache.native_decode and native_attention.usable(query, key, value):
        out, probs = native_attention.decode_attention(query, key, value, incoming, mask, sink_query, sink_slot,
                                                       scaling, probs=layer.attention is not None)
        _observe_call(cache, layer, probs, mask, total)
        return out
    rows = _block_rows(batch, q_heads, key.shape[2])  # (never a verification's few queries: the blocks read the host)
    if q > max(rows, FEW_QUERIES) and incoming is None and sink_query is None and _blockable(layer, key, value):
        return _attention_by_query_blocks(cache, layer, query, key, value, mask, scaling, rows)
    queries = query if sink_query is None else torch.cat((query, sink_query), dim=2)
    scores = attention_scores(queries, key, scaling)
    if incoming is not None:
        scores = torch.cat((scores, attention_scores(queries, incoming[0], scaling)), dim=-1)
    if sink_query is not None:  # each slot takes its own frame's logit
        scores = torch.where(sink_slot[:, :, None], scores[:, :, :, q:], scores[:, :, :, :q])
    if mask is not None:  # in place: one [B, H, q, T] temporary less
        scores.masked_fill_(~mask[:, :, None], -torch.inf)
    probs = torch.softmax(scores, dim=-1)
    _observe_call(cache, layer, probs if layer.attention is not None else None, mask, total)
    grouped = probs.to(value.dtype).view(batch, key.shape[1], -1, total)
    out = value.weigh(grouped[..., :held]) if isinstance(value, HeldCodes) else grouped[..., :held] @ value
    if incoming is not None:
        out = out + grouped[..., held:] @ incoming[1]
    return out.view(batch, q_heads, q, -1)


def _observe_call(cache, layer, probs: torch.Tensor | None, mask: torch.Tensor | None, total: int) -> None:
    """Add a call's attention probabilities ``[B, Hkv, group, q, total]`` (None: the policy observes none) to the
    layer's statistic."""
    if probs is None:
        return
    step = cache.step
    visible = total if mask is None else mask.sum(-1)[:, :, None, :, None]  # keys each query sees
    real = None if probs.shape[3] == 1 and not cache.padded else step.new_valid[:, None, None, :, None]
    observe(layer.policy, layer.attention[:, :, :total], probs, visible, real, step.new_index)


def _blockable(layer, key, value) -> bool:
    """Whether a call's attention can be taken a block of queries at a time: plain K/V (codes are weighed whole), and
    a statistic that adds up over queries (H2O's sums, Scissorhands' votes) or none."""
    if isinstance(key, HeldCodes) or isinstance(value, HeldCodes):
        return False
    return layer.attention is None or (layer.attention.dim() == 3
                                       and layer.policy.attention_statistic in ("sum", "pivotal", "max"))


def _block_rows(batch: int, q_heads: int, keys: int) -> int:
    """Queries a block of a long call's grouped attention: ``QUERY_BLOCK``, fewer where the block's scores would pass
    ``SCORES_PER_BLOCK``."""
    return max(16, min(QUERY_BLOCK, SCORES_PER_BLOCK // (batch * q_heads * keys)))


def _attention_by_query_blocks(cache, layer, query, key, value, mask, scaling: float, rows: int):
    """``_grouped_attention`` of a long call, ``rows`` queries at a time (``_block_rows``), each block over the keys
    from the first to the last one any of its queries sees (a sliding-window layer's window, not every key), masked
    only where one of them is denied a key: the same rows of probabilities, none of them for keys the mask hides. One
    host read per call (the blocks' bounds): a prefill's, never a decode step's."""
    batch, q_heads, q, _ = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    blocks = -(-q // rows)
    if mask is None:
        bounds = [[0, total, total, total]] * blocks
    else:  # per block: the first and one past the last key any query sees, the first and one past the last one denied
        def any_in_block(keys_of_queries: torch.Tensor) -> torch.Tensor:  # [q, T] -> [blocks, T]
            return F.pad(keys_of_queries, (0, 0, 0, -q % rows)).view(blocks, rows, total).any(1)

        seen = any_in_block(mask.any(dim=(0, 1)))
        denied = any_in_block(~mask.all(dim=(0, 1))) & seen
        columns = torch.arange(total, device=query.device)
        bounds = torch.stack([bound for keys in (seen, denied) for bound in (
            torch.where(keys, columns, total).amin(-1), torch.where(keys, columns + 1, 0).amax(-1))], dim=-1).tolist()
    outs = []
    for start, (first, limit, first_denied, last_denied) in zip(range(0, q, rows), bounds):
        block, keys = slice(start, start + rows), slice(first, limit)
        scores = attention_scores(query[:, :, block], key[:, :, keys], scaling)
        if first_denied < last_denied:
            scores[..., first_denied - first:last_denied - first].masked_fill_(
                ~mask[:, :, None, block, first_denied:last_denied], -torch.inf)
        probs = torch.softmax(scores, dim=-1)
        if layer.attention is not None:
            visible = total if mask is None else mask[:, :, block].sum(-1)[:, :, None, :, None]
            real = cache.step.new_valid[:, None, None, block, None] if cache.padded else None  # (None: all real)
            observe(layer.policy, layer.attention[:, :, keys], probs, visible, real)
        out = probs.to(value.dtype).view(batch, kv_heads, -1, limit - first) @ value[:, :, keys]
        outs.append(out.view(batch, q_heads, scores.shape[3], -1))
    return torch.cat(outs, dim=2)


def _make_attention(backend: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        cache = kwargs.pop(CACHE_KWARG, None)
        if cache is None:
            fn = ALL_ATTENTION_FUNCTIONS["sdpa"] if backend == "sdpa" else model_eager_attention(module)
            return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        window = kwargs.get("sliding_window")
        if getattr(cache, "packed", False):  # several caches' tokens in one call: each part over its own cache
            return cache.attend(module.layer_idx, query, lambda part, layer, query, key, value: eviction_attention(
                part, layer, query, key, value, scale, window)), None
        layer = cache.layer_for(module.layer_idx)
        return eviction_attention(cache, layer, query, key, value, scale, window), None

    return attention


_registered: list[str] = []


def _register() -> None:
    """sparsegen's attention functions in transformers' registries, on first use (importing sparsegen registers
    nothing)."""
    for backend in BACKENDS:
        if backend not in _registered:
            AttentionInterface.register(f"sparsegen_{backend}", _make_attention(backend))
            AttentionMaskInterface.register(f"sparsegen_{backend}", sdpa_mask if backend == "sdpa" else eager_mask)
            _registered.append(backend)


def _begin(module, args, kwargs):
    """Before the decoder runs: tell an evicting cache what the call brings, and pass it on to every attention call
    (transformers hands a layer's attention function the decoder's extra keyword arguments, not the cache)."""
    cache = passed_cache(kwargs)
    if not getattr(cache, "evicting", False):  # any other cache: transformers' own attention, unchanged
        return None
    inputs = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if inputs is None and args:
        inputs = args[0]
    cache.begin_step(inputs.shape[0], inputs.shape[1], kwargs.get("attention_mask"), kwargs.get("position_ids"),
                     inputs.device)
    return args, {**kwargs, CACHE_KWARG: cache}


def _end(module, args, kwargs, output):
    cache = kwargs.get(CACHE_KWARG)
    if cache is not None:
        cache.end_step()


def prepare(model: torch.nn.Module) -> None:
    """Make ``model`` evict through sparsegen (idempotent). Other caches keep transformers' exact behaviour."""
    family(model.config.model_type)  # (refuses an architecture sparsegen does not know)
    _register()
    current = attention_implementation(model)
    if not current.startswith("sparsegen_"):
        if current not in BACKENDS:
            raise ValueError(f"unsupported attention backend {current!r}: load the model with "
                             f"attn_implementation='sdpa' or 'eager'")
        model.set_attn_implementation(f"sparsegen_{current}")
    decoder = model.get_decoder()
    if not getattr(decoder, "_sparsegen_hooks", None):
        decoder._sparsegen_hooks = (decoder.register_forward_pre_hook(_begin, with_kwargs=True),
                                    decoder.register_forward_hook(_end, with_kwargs=True, always_call=True))
        route(model)


def release(model: torch.nn.Module) -> None:
    """Undo ``prepare``: the model's own attention implementation back, the decoder hooks removed. (A prepared
    model already behaves exactly as transformers' with any other cache; this leaves no trace at all.)"""
    current = attention_implementation(model)
    if current.startswith("sparsegen_"):
        model.set_attn_implementation(current.removeprefix("sparsegen_"))
    decoder = model.get_decoder()
    for handle in getattr(decoder, "_sparsegen_hooks", None) or ():
        handle.remove()
    decoder._sparsegen_hooks = None
    unroute(model)


def is_prepared(model: torch.nn.Module) -> bool:
    return bool(getattr(model.get_decoder(), "_sparsegen_hooks", None))


@contextmanager
def patched(model: torch.nn.Module):
    """``with patched(model):`` eviction installed for the block (``prepare``) and removed after (``release``) unless
    it was installed before: the model leaves configured, hooked and behaving exactly as it came in."""
    before = is_prepared(model)
    prepare(model)
    try:
        yield model
    finally:
        if not before:
            release(model)
