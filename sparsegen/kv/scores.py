"""What attention says about held tokens: each slot's rank (its rolling position), grouped queries' fp32 scores, and
a policy's statistic folded from attention probabilities (H2O's sums, TOVA's last query, Scissorhands' votes,
SnapKV's window)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsegen.kv.quantized import HeldCodes


def slot_ranks(index: torch.Tensor, valid: torch.Tensor, sinks: int | None = None) -> torch.Tensor:
    """Each slot's rank among the valid slots of its row by token order: the rolling position.

    With ``sinks`` (an order policy: the held tokens are the first ``sinks`` plus one unbroken run) the rank
    is computed without sorting. Invalid slots get rank 0.
    """
    if sinks is not None:
        is_sink = index < sinks
        sinks_held = (valid & is_sink).sum(-1, keepdim=True)
        first_recent = index.masked_fill(~valid | is_sink, torch.iinfo(index.dtype).max).min(-1, keepdim=True).values
        ranks = torch.where(is_sink, index, sinks_held + index - first_recent)
        return ranks.masked_fill(~valid, 0)
    order = torch.argsort(index.masked_fill(~valid, torch.iinfo(index.dtype).max), dim=-1, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return ranks.masked_fill(~valid, 0)


# the context's first tokens in every KVzip copy query's softmax beside the chunk it copies (attention sinks: KVzip's
# and kvpress's n_sink)
RECONSTRUCTION_SINKS = 4


def scored_by_copy(index: torch.Tensor, reading: tuple[int, int]) -> torch.Tensor:
    """Which held tokens (by ordinal ``index``) a chunk of KVzip's copy scores, ``reading`` being the ordinals
    ``[first, end)`` it copies: those and the context's first ``RECONSTRUCTION_SINKS``."""
    return ((index >= reading[0]) & (index < reading[1])) | (index < RECONSTRUCTION_SINKS)


def attention_scores(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """fp32 logits ``[B, Hkv, group, q, T]`` of grouped queries against their KV head's keys."""
    batch, q_heads, q, head_dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.float().reshape(batch, kv_heads, q_heads // kv_heads * q, head_dim)
    if isinstance(key, HeldCodes):
        scores = key.scores(grouped) * scaling
    else:  # (the scaling inside the product: one pass over the [q, T] scores less; equal to within float rounding)
        keys = key.float().transpose(-1, -2)
        scores = torch.baddbmm(grouped.new_empty(()), grouped.flatten(0, 1), keys.flatten(0, 1), beta=0, alpha=scaling)
    return scores.view(batch, kv_heads, q_heads // kv_heads, q, -1)


def observed_queries(policy, q: int) -> int | None:
    """How many of a call's last queries a policy's statistic reads, where that is under half of the ``q``: SnapKV's
    observation window, TOVA's last query (None: every query, as H2O's sums and Scissorhands' votes need, or a call
    too short to gain)."""
    if not policy.needs_attention or policy.history is not None:
        return None
    last = {"window": getattr(policy, "window", None), "latest": 1}.get(policy.attention_statistic)
    return last if last is not None and 2 * last < q else None


def observe(policy, attention: torch.Tensor, probs: torch.Tensor, visible, real: torch.Tensor | None = None,
            index: torch.Tensor | None = None) -> None:
    """Fold what queries' attention ``probs`` ``[B, Hkv, group, q, T]`` says about each held token into ``attention``
    ``[B, Hkv, T]`` by the policy's statistic: "sum" adds it (H2O), "latest" keeps the last query's (TOVA),
    "pivotal" counts the query heads that gave the token more than the average 1 / ``visible`` (Scissorhands),
    "window" adds the attention of the call's last ``policy.window`` queries (SnapKV's observation window), "max"
    keeps the most any query head paid (KVzip).
    ``real``: which queries are real tokens (padding adds nothing). Under a history window (``policy.history``)
    ``attention`` is ``[B, Hkv, T, history]`` and query ``index`` (``[B, q]``, its ordinal) writes column
    ``index % history`` over what the query ``history`` before it wrote."""
    statistic = policy.attention_statistic
    if statistic == "latest":  # left padding: the last query is real
        attention.copy_(probs[:, :, :, -1].sum(2))
        return
    if statistic == "window":  # the call's last queries only (left padding: they are the real ones)
        probs = probs[:, :, :, -policy.window:]
        real = None if real is None else real[:, :, :, -policy.window:]
    if statistic == "pivotal":
        probs = (probs > 1 / visible).float()
    if real is not None:
        probs = probs.masked_fill(~real, 0)
    if statistic == "max":
        attention.copy_(torch.maximum(attention, probs.amax(dim=(2, 3))))
        return
    if attention.dim() == 4:
        width = attention.shape[-1]
        columns = F.one_hot(index[:, -width:] % width, width).to(probs.dtype)  # [B, q, history]; the last queries win
        if real is not None:  # a pad shares its ordinal with the real token before it: it writes nothing
            columns *= real[:, 0, 0, -width:]
        attention.mul_(1 - columns.amax(1)[:, None, None]).add_(
            torch.einsum("bhqt,bqw->bhtw", probs[:, :, :, -width:].sum(2), columns))
        return
    attention += probs.sum(dim=(2, 3))
