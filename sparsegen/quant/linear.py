"""A linear layer whose weight is stored as 4- or 8-bit codes with per-group float16 scales and zero points.

The weight is dequantized at each forward (``F.linear`` then runs in the input's dtype): the model is smaller
in memory and on disk, not faster — weight-only quantization pays off in speed only with fused low-bit
kernels, which PyTorch does not ship for CPU and CUDA alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsegen.quant.groups import GroupQuantizer, check_bits, group_width


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8 [rows, columns]`` codes -> bytes: 8-bit as is, 4-bit two per byte (even column in the low nibble)."""
    if bits == 8:
        return codes.contiguous()
    if codes.shape[1] % 2:
        codes = F.pad(codes, (0, 1))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    if bits == 8:
        return packed
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(1)[:, :columns]


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W = (codes - zeros) * scales`` per group of ``group_size`` input columns."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        check_bits(bits, group_size)
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.group_size = group_width(group_size, in_features)
        groups = -(-in_features // self.group_size)
        packed_columns = in_features if bits == 8 else -(-in_features // 2)
        self.register_buffer("qweight", torch.zeros(out_features, packed_columns, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.float16, device=device))
        self.register_buffer("zeros", torch.zeros(out_features, groups, dtype=torch.uint8, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight: torch.Tensor, quantizer: GroupQuantizer) -> QuantLinear:
        """Store ``weight`` (already on ``quantizer``'s grids) in place of ``linear``."""
        module = cls(linear.in_features, linear.out_features, quantizer.bits, quantizer.width,
                     linear.bias is not None, linear.weight.dtype, linear.weight.device)
        module.qweight.copy_(pack(quantizer.codes(weight), quantizer.bits))
        module.scales.copy_(quantizer.scales.half())
        module.zeros.copy_(quantizer.zeros.to(torch.uint8))
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.data)
        return module

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        codes = unpack(self.qweight, self.bits, self.in_features).float()
        scales = self.scales.float().repeat_interleave(self.group_size, dim=1)[:, : self.in_features]
        zeros = self.zeros.float().repeat_interleave(self.group_size, dim=1)[:, : self.in_features]
        return ((codes - zeros) * scales).to(dtype or self.scales.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")
