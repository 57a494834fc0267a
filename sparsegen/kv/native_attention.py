"""``sparsegen::decode_attention`` (``decode_attention.cpp``): a decode step's attention on a CPU in one pass over
the held keys and values, the step's own token beside them, free and hidden slots masked, the sinks of rolling
positions in their own frame; the probabilities only where a policy observes them. A few queries a row (a speculative
verification) take it too, each key read once for all of them. ``_grouped_attention`` computes the same with grouped
matmuls and a softmax: what runs where this kernel does not (a GPU, bfloat16, quantized K/V, more queries, no
compiler), and the tests' reference."""

from __future__ import annotations

import functools
import os
import warnings

import torch

from sparsegen import native
from sparsegen.kv.quantized import HeldCodes

MOST_QUERIES = 17  # a row's queries the kernel takes: a speculative verification's pending token and 16 drafts

native.LIBRARY.define("decode_attention(Tensor query, Tensor? sink_query, Tensor key, Tensor value, Tensor? new_key, "
                      "Tensor? new_value, Tensor? visible, Tensor? sink, float scaling, bool probs) "
                      "-> (Tensor, Tensor)")


@torch.library.register_fake("sparsegen::decode_attention", lib=native.LIBRARY)
def _(query, sink_query, key, value, new_key, new_value, visible, sink, scaling, probs):
    batch, heads, group, _ = query.shape
    total = key.shape[2] + (0 if new_key is None else new_key.shape[2])
    return (query.new_empty(batch, heads, group, value.shape[-1]),
            query.new_empty(batch, heads, group, total) if probs else query.new_empty(0))


@functools.cache
def ready() -> bool:
    """Whether the kernel runs in this process: built (once; a warning where it cannot be), and
    ``SPARSEGEN_DECODE_KERNEL=0`` not set (the grouped matmuls instead, to compare). Asked when a CPU cache is built,
    outside any compiled step."""
    if os.environ.get("SPARSEGEN_DECODE_KERNEL") == "0":
        return False
    failure = native.build()
    if failure is not None:
        warnings.warn(f"sparsegen's C++ kernels could not be built ({failure}): decode steps attend by grouped "
                      "matmuls instead, slower. Install a C++ compiler (g++) and ninja to build them.", stacklevel=3)
    return failure is None


def usable(query: torch.Tensor, key, value) -> bool:
    """Whether the kernel takes this call (given ``ready``): up to ``MOST_QUERIES`` fp32 queries a row, plain held K/V
    in fp32 or fp16."""
    return (query.shape[2] <= MOST_QUERIES and query.dtype == torch.float32 and not isinstance(key, HeldCodes)
            and not isinstance(value, HeldCodes) and key.dtype == value.dtype in (torch.float32, torch.float16))


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     incoming: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None,
                     sink_query: torch.Tensor | None, sink_slot: torch.Tensor | None, scaling: float,
                     probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``query`` ``[B, q_heads, q, D]`` over ``key``/``value`` ``[B, Hkv, S, D]`` and ``incoming`` (the call's own
    K/V, ``[B, Hkv, q, D]``, slots S.., read in the held K/V's dtype, as they will be stored), ``mask``
    ``[B or 1, 1 or Hkv, q, T]``, ``sink_slot`` ``[B, 1, 1, T]`` (slots scored with ``sink_query``): the output
    ``[B, q_heads, q, Dv]`` and, with ``probs``, ``[B, Hkv, group, q, T]``."""
    batch, q_heads, q, dim = query.shape
    heads, group = key.shape[1], q_heads // key.shape[1]
    grouped = query.reshape(batch, heads, group * q, dim)  # (a KV head's rows: its query heads' queries)
    new_key, new_value = (None, None) if incoming is None else (incoming[0].to(key.dtype), incoming[1].to(key.dtype))
    out, weights = torch.ops.sparsegen.decode_attention(
        grouped, None if sink_query is None else sink_query.reshape(grouped.shape), key, value, new_key, new_value,
        None if mask is None else mask.expand(batch, -1, -1, -1), None if sink_slot is None else sink_slot[:, :, 0],
        scaling, probs)
    return out.view(batch, q_heads, q, -1), weights.view(batch, heads, group, q, -1) if probs else None
