"""``sparsegen::decode_attention`` (``decode_attention.cpp``): a decode step's attention on a CPU in one pass over
the held keys and values, the step's own token beside them, free and hidden slots masked, the sinks of rolling
positions in their own frame; the probabilities only where a policy observes them. ``_grouped_attention`` computes the
same with grouped matmuls and a softmax: what runs where this kernel does not (a GPU, bfloat16, quantized K/V, more
than one query, no compiler), and the tests' reference."""

from __future__ import annotations

import functools
import os
import warnings

import torch

from sparsegen import native
from sparsegen.kv.quantized import HeldCodes

native.LIBRARY.define("decode_attention(Tensor query, Tensor? sink_query, Tensor key, Tensor value, Tensor? new_key, "
                      "Tensor? new_value, Tensor? visible, Tensor? sink, float scaling, bool probs) "
                      "-> (Tensor, Tensor)")


@torch.library.register_fake("sparsegen::decode_attention", lib=native.LIBRARY)
def _(query, sink_query, key, value, new_key, new_value, visible, sink, scaling, probs):
    batch, heads, group, _ = query.shape
    total = key.shape[2] + (new_key is not None)
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
    """Whether the kernel takes this call (given ``ready``): one fp32 query per row, plain held K/V in fp32 or fp16."""
    return (query.shape[2] == 1 and query.dtype == torch.float32 and not isinstance(key, HeldCodes)
            and not isinstance(value, HeldCodes) and key.dtype == value.dtype in (torch.float32, torch.float16))


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     incoming: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None,
                     sink_query: torch.Tensor | None, sink_slot: torch.Tensor | None, scaling: float,
                     probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``query`` ``[B, q_heads, 1, D]`` over ``key``/``value`` ``[B, Hkv, S, D]`` and ``incoming`` (the step's own
    K/V, ``[B, Hkv, 1, D]``, slot S, read in the held K/V's dtype, as they will be stored), ``mask``
    ``[B, 1 or Hkv, 1, T]``, ``sink_slot`` ``[B, 1, 1, T]`` (slots scored with ``sink_query``): the output
    ``[B, q_heads, 1, Dv]`` and, with ``probs``, ``[B, Hkv, group, 1, T]``."""
    batch, q_heads, _, dim = query.shape
    heads = key.shape[1]
    grouped = query.view(batch, heads, q_heads // heads, dim)
    new_key, new_value = (None, None) if incoming is None else (incoming[0].to(key.dtype), incoming[1].to(key.dtype))
    out, weights = torch.ops.sparsegen.decode_attention(
        grouped, None if sink_query is None else sink_query.view(grouped.shape), key, value, new_key, new_value,
        None if mask is None else mask[:, :, 0], None if sink_slot is None else sink_slot[:, :, 0], scaling, probs)
    return out.view(batch, q_heads, 1, -1), weights[:, :, :, None] if probs else None
