"""A context compressed as a whole (``Policy.compresses_whole``): encoded in one pass, holding every token, and only
then compressed to the budget, by scores that saw all of it (kvpress's protocol).

Context reconstruction (KVzip's scoring, ``Policy.reconstructs``) comes between: the model reads the context again
right after it, a chunk at a time, teacher-forced, and each held token's score is the most attention a query head of
that second reading pays it, each copy query's attention taken as a softmax over the context's first tokens, the
chunk it copies and the copy itself (KVzip's normalisation, and kvpress's); the reading's own tokens are forgotten
after each chunk.

The second reading runs the linears over the context's tokens again; its hidden states attend to the whole context
(SDPA, twice a causal prefill's average), and only its scores' softmax is formed, over the chunk's own tokens. It
holds the whole context plus one chunk while it runs. It needs no question and no tokenizer: the repeated text itself
is the cue (the model's copying heads look back at the token that came next the first time). KVzip's paper puts an
instruction ("Repeat the previous context") before the copy; sparsegen leaves it out, which also keeps the pass the
same for every model.
"""

from __future__ import annotations

import torch

from sparsegen.engine.step import forward
from sparsegen.kv.cache import EvictionCache
from sparsegen.kv.policies.full import Full
from sparsegen.kv.policy import Policy
from sparsegen.kv.rollback import forget_last


def _unbounded(policy: Policy, scores: bool, rows_per_head: bool) -> Policy:
    """``policy`` evicting nothing (no budget), observing attention only if it ``scores``. ``rows_per_head``: where its
    heads share one pool of slots, they hold a row each while the context is read (attention over rows of their own
    is the faster), pooled when it is compressed (``EvictionCache.compress``)."""
    own = policy.with_budget(None)
    own.needs_attention = own.needs_attention and scores
    own.shares_slots = own.shares_slots and not rows_per_head
    return own


def reads_whole(cache) -> bool:
    """Whether a cache's next prompt is encoded whole, then compressed: a fresh ``EvictionCache`` under a policy that
    ``compresses_whole`` (a transformers cache, the bench's dense rows, never)."""
    return isinstance(cache, EvictionCache) and cache.seen is None and cache.policy.compresses_whole


def compress_whole(model: torch.nn.Module, cache, ids: torch.Tensor, positions: torch.Tensor,
                   mask: torch.Tensor | None, chunk_size: int) -> torch.Tensor:
    """Feed the contexts ``ids`` ``[B, n]`` (left-padded where ``mask`` says) at ``positions`` into a fresh ``cache``
    under a policy that ``compresses_whole``, score them (by reconstruction, where it ``reconstructs``) and compress
    them to the budget: the last logits ``[B, vocab]``, as a plain prefill gives."""
    policies = [layer.policy for layer in cache.layers]
    # (low-bit codes' key scales are per layout: a pool of codes is one from the start)
    rows_per_head = all(layer.quantization is None for layer in cache.layers)
    try:
        for layer, policy in zip(cache.layers, policies):  # the context in one pass, held whole
            layer.policy = _unbounded(policy, not policy.reconstructs, rows_per_head) if policy.compresses_whole \
                else Full()
        logits = forward(model, cache, ids, positions, mask, last=True)
        if any(policy.reconstructs for policy in policies):
            _read_again(model, cache, ids, positions, mask, chunk_size, policies, rows_per_head)
    finally:
        for layer, policy in zip(cache.layers, policies):
            layer.policy = policy
    cache.compress()
    return logits


def _read_again(model: torch.nn.Module, cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                chunk_size: int, policies: list[Policy], rows_per_head: bool) -> None:
    """KVzip's scores: the contexts held whole are read again, each row its own tokens at the positions after its own,
    and every held token keeps the most attention a query head of that reading pays it; the reading is forgotten."""
    for layer, policy in zip(cache.layers, policies):  # scored, none evicted (no budget) until all is read
        room = layer.used + chunk_size * layer.fan  # one chunk of the copy, not twice the context
        if layer.keys.shape[2] < room:
            layer._reallocate(room)
        if policy.reconstructs:
            layer.policy = _unbounded(policy, True, rows_per_head)
            layer.attention = torch.zeros(layer.valid.shape, dtype=torch.float32, device=layer.device)
    # each row's own tokens again, from its first (left-aligned: its chunks are those it would read alone), at the
    # positions after its own
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    again = ids.gather(1, torch.argsort((~real).byte(), dim=1, stable=True))
    columns = torch.arange(ids.shape[1], device=ids.device)
    again_real, again_positions = columns < real.sum(-1, keepdim=True), positions[:, -1:] + 1 + columns
    length = cache.length
    try:
        for start in range(0, ids.shape[1], chunk_size):
            piece = slice(start, start + chunk_size)
            held = torch.ones_like(ids[:, :length])  # (the cache masks its own held tokens; the model its new)
            cache.reading_again = start, start + chunk_size  # (the ordinals this chunk copies: what its scores rank)
            forward(model, cache, again[:, piece], again_positions[:, piece],
                    None if mask is None else torch.cat((held, again_real[:, piece].long()), dim=1), last=True)
            forget_last(cache, again_real[:, piece].sum(-1))
            cache.length = length  # (rows that forgot different counts, their pads: the context's own length)
    finally:
        cache.reading_again = None
