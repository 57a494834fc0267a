"""Linear layers that do only part of their work for the current tokens: the kernels of contextual sparsity.

Both compute exactly the dense layer with some units zeroed. Multi-token calls (prefill, perplexity windows)
run dense matmuls with the zeros applied, so quality measured there is the quality decode gets. Decode
calls (one token per sequence) touch only the weights of the chosen units:

- ``RowSparseLinear`` (gate/up/fc1, q_proj by head) computes the chosen output rows — the rows of its
  ``[out, in]`` weight, contiguous in memory — from one gathered block, and leaves the other outputs 0.
  For a batch it computes the union of the rows its sequences chose.
- ``ColumnSparseLinear`` (down/fc2, o_proj by head; every linear under TEAL) uses only the chosen input
  columns. It stores its weight transposed, ``[in, out]``, so an input unit's weights are one contiguous row,
  and sums ``x_i * W_t[i]`` over each sequence's own chosen units with ``embedding_bag`` — a fused
  gather-and-accumulate that reads nothing else and writes no intermediate (on a CPU the chosen units of a
  single sequence are split into one bag per thread, so both cores stream weights).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class Selection(Protocol):
    """Which units (neurons, or heads of ``unit_size`` features) each token keeps."""

    def mask(self, x: torch.Tensor) -> torch.Tensor | None:
        """Boolean ``[..., units]``, one row per token of ``x``; None: every unit (the layer runs dense)."""

    def union(self) -> torch.Tensor | None:
        """At decode, the sorted units kept by any sequence of the batch, when known without the mask."""


def _expand(mask: torch.Tensor, unit_size: int, copies: int = 1) -> torch.Tensor:
    """Unit mask -> feature mask (a head is ``unit_size`` features; fused [gate; up] repeats the neurons)."""
    if unit_size > 1:
        mask = mask.repeat_interleave(unit_size, dim=-1)
    return mask.repeat(*([1] * (mask.dim() - 1)), copies) if copies > 1 else mask


def _features(units: torch.Tensor, unit_size: int, copies: int, features: int) -> torch.Tensor:
    """Sorted unit indices -> the sorted feature indices they cover (each copy is ``features // copies`` long)."""
    if unit_size > 1:
        units = (units[:, None] * unit_size + torch.arange(unit_size, device=units.device)).flatten()
    if copies > 1:
        units = torch.cat([units + copy * (features // copies) for copy in range(copies)])
    return units


def _bag_offsets(counts: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """``embedding_bag`` offsets; a single sequence on a CPU is split into one bag per thread."""
    if len(counts) == 1 and device.type == "cpu":
        bags = max(1, min(torch.get_num_threads(), total))
        counts = torch.full((bags,), total // bags, device=device)
        counts[: total % bags] += 1
    return torch.cumsum(counts, 0) - counts


class RowSparseLinear(nn.Module):
    """Computes the output units ``select`` chooses; the others are 0."""

    def __init__(self, linear: nn.Linear, select: Selection, decoding: Callable[[], bool], unit_size: int = 1,
                 copies: int = 1):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.select, self.decoding, self.unit_size, self.copies = select, decoding, unit_size, copies
        self._rows = torch.empty(0)  # reused gather buffer: a fresh one each step costs page faults

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.decoding():
            out, mask = F.linear(x, self.weight, self.bias), self.select.mask(x)
            return out if mask is None else out * _expand(mask, self.unit_size, self.copies).reshape(out.shape)
        units = self.select.union()
        if units is None:
            mask = self.select.mask(x)
            units = mask.reshape(-1, mask.shape[-1]).any(0).nonzero().squeeze(-1)
        rows = _features(units, self.unit_size, self.copies, self.out_features)
        if self._rows.shape[0] < len(rows) or self._rows.device != x.device or self._rows.dtype != x.dtype:
            self._rows = torch.empty(len(rows), self.in_features, dtype=x.dtype, device=x.device)
        block = torch.index_select(self.weight.detach(), 0, rows, out=self._rows[:len(rows)])  # inference only
        out = x.new_zeros(*x.shape[:-1], self.out_features)
        out[..., rows] = F.linear(x, block, None if self.bias is None else self.bias[rows])
        return out

    def to_linear(self) -> nn.Linear:
        return _linear(self.weight, self.bias)


class ColumnSparseLinear(nn.Module):
    """Uses only the input units ``select`` chooses for each token (the others count as 0)."""

    def __init__(self, linear: nn.Linear, select: Selection, decoding: Callable[[], bool], unit_size: int = 1):
        super().__init__()
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.select, self.decoding, self.unit_size = select, decoding, unit_size

    @property
    def weight(self) -> torch.Tensor:  # model code that reads ``.weight`` (dtype, device) keeps working
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.decoding():
            mask = self.select.mask(x)
            if mask is not None:
                x = x * _expand(mask, self.unit_size).reshape(x.shape)
            return F.linear(x, self.weight_t.t(), self.bias)
        flat = x.reshape(-1, self.in_features)  # one row per sequence
        batch = flat.shape[0]
        units = self.select.union() if batch == 1 else None  # one sequence: its own units are the union
        if units is not None:
            columns = _features(units, self.unit_size, 1, self.in_features)
            weights, counts = flat[0, columns], torch.tensor([len(columns)], device=x.device)
        else:
            keep = _expand(self.select.mask(x), self.unit_size).reshape(batch, -1)
            chosen = keep.nonzero()  # (sequence, column), grouped by sequence
            columns, weights, counts = chosen[:, 1], flat[chosen[:, 0], chosen[:, 1]], keep.sum(-1)
        offsets = _bag_offsets(counts, len(columns), x.device)
        out = F.embedding_bag(columns, self.weight_t, offsets, mode="sum", per_sample_weights=weights)
        if batch == 1:
            out = out.sum(0, keepdim=True)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def to_linear(self) -> nn.Linear:
        return _linear(self.weight_t.t().contiguous(), self.bias)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        linear.bias = bias
    return linear
