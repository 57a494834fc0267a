"""Symmetric integer grids per group of input columns: the numbers every weight-only quantizer here shares.

A row's columns are cut into groups of ``group_size``; each group gets a scale (stored in float16), and its
weights become signed integers ``q`` in ``[-2**(bits-1), 2**(bits-1) - 1]`` with ``w ~ q * scale``. Symmetric
grids are what llm-compressor's W4A16/W8A16 schemes write and vLLM's kernels read; they contain 0, so weights a
pruner set to zero stay exactly zero after quantization. Codes are stored offset to ``[0, 2**bits - 1]``
(``code = q + 2**(bits-1)``), the zero point every grid shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)


def check_bits(bits: int, group_size: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {', '.join(map(str, BITS))}, got {bits}")
    if group_size < 0:
        raise ValueError(f"group size must be a positive number of columns (or 0 for one group per row), got "
                         f"{group_size}")


def check_groups(columns: int, group_size: int) -> None:
    """Groups must tile a row exactly (compressed-tensors and vLLM's kernels need it); one wider than the row is the
    whole row."""
    if columns % group_width(group_size, columns):
        raise ValueError(f"a linear with {columns} inputs cannot be cut into groups of {group_size} columns; use a "
                         f"group size that divides every linear's inputs (e.g. 64 or 32), or 0 (per row)")


def group_width(group_size: int, columns: int) -> int:
    """Columns per group; 0 means one group for the whole row."""
    return columns if group_size == 0 else min(group_size, columns)


@dataclass
class Grid:
    """Scale of one group of columns, per row (``[rows, 1]``), and the grid's shared zero point."""

    scale: torch.Tensor  # fp32 holding float16-representable values
    zero: int  # the code of 0: 2**(bits-1)
    maxq: int

    @classmethod
    def fit(cls, weights: torch.Tensor, bits: int) -> Grid:
        """The grid whose extreme codes reach the largest magnitude in each row of ``weights`` ``[rows, columns]``."""
        maxq = 2**bits - 1
        reach = weights.float().abs().amax(dim=1, keepdim=True)
        scale = 2 * reach / maxq
        # stored as float16: round up by one float16 ulp so the range still covers the weights
        scale = (scale * (1 + 2**-10)).half().float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
        return cls(scale, 2 ** (bits - 1), maxq)

    def codes(self, weights: torch.Tensor) -> torch.Tensor:
        return (torch.round(weights.float() / self.scale) + self.zero).clamp(0, self.maxq)

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        return (codes - self.zero) * self.scale

    def round(self, weights: torch.Tensor) -> torch.Tensor:
        """The nearest point of the grid to each weight (what quantize-then-dequantize gives)."""
        return self.dequantize(self.codes(weights))


class GroupQuantizer:
    """Fits one grid per group as a column sweep reaches it and rounds each column to its group's grid.

    Used by round-to-nearest (all columns at once) and by GPTQ, which calls ``column`` left to right with
    the block of weights already updated for the error of the columns before.
    """

    def __init__(self, rows: int, columns: int, bits: int, group_size: int, device: torch.device):
        check_bits(bits, group_size)
        self.bits, self.width = bits, group_width(group_size, columns)
        groups = -(-columns // self.width)
        self.scales = torch.zeros(rows, groups, device=device)
        self.zero = 2 ** (bits - 1)
        self.grid: Grid | None = None

    def column(self, block: torch.Tensor, block_start: int, i: int, pruned: torch.Tensor | None = None) -> torch.Tensor:
        """Column ``block_start + i`` rounded to its group's grid, the grid fitted from ``block`` when a group starts
        (a group must lie inside one block), counting the weights ``pruned`` marks as the zeros they will be."""
        col = block_start + i
        if col % self.width == 0:
            group = block[:, i:i + self.width]
            self.fit_group(group if pruned is None else group.masked_fill(pruned[:, i:i + self.width], 0),
                           col // self.width)
        return self.grid.round(block[:, i:i + 1])[:, 0]

    def fit_group(self, weights: torch.Tensor, group: int) -> None:
        self.grid = Grid.fit(weights, self.bits)
        self.scales[:, group] = self.grid.scale[:, 0]

    def codes(self, weight: torch.Tensor) -> torch.Tensor:
        """Integer codes ``[rows, columns]`` of weights already on the fitted grids."""
        scale = self.expand(self.scales, weight.shape[1])
        return (torch.round(weight.float() / scale) + self.zero).clamp(0, 2**self.bits - 1).to(torch.uint8)

    def expand(self, per_group: torch.Tensor, columns: int) -> torch.Tensor:
        return per_group.repeat_interleave(self.width, dim=1)[:, :columns]


def round_to_nearest(weight: torch.Tensor, bits: int, group_size: int) -> GroupQuantizer:
    """Fit every group's grid to ``weight`` ``[out, in]`` directly (no error compensation)."""
    quantizer = GroupQuantizer(weight.shape[0], weight.shape[1], bits, group_size, weight.device)
    for group, start in enumerate(range(0, weight.shape[1], quantizer.width)):
        quantizer.fit_group(weight[:, start:start + quantizer.width], group)
    return quantizer
