"""A linear layer whose weight is stored as 4- or 8-bit symmetric integers with per-group float16 scales, laid out
as compressed-tensors' ``pack-quantized`` format (the one llm-compressor writes and vLLM serves): ``weight_packed``
(int32 words, each holding 32 / bits consecutive codes of a row, the first in the lowest bits, codes offset to be
non-negative), ``weight_scale`` (``[out, groups]``) and ``weight_shape``. A model's ``state_dict`` is therefore
already the checkpoint other tools read.

On CPU, 4-bit layers running in bfloat16 (groups of 32, 64, 128 or 256) use PyTorch's packed int4 matmul
(``_weight_int4pack_mm_for_cpu``, the kernel torchao's int4 weight-only path calls), which reads a quarter of the
bytes of a bfloat16 weight: decode, bound by weight reads, gets faster. Elsewhere (float32, float16, 8 bits, CUDA)
the weight is dequantized at each forward and ``F.linear`` runs in the input's dtype: the model is smaller, not
faster.

``DynamicInputQuantLinear`` is compressed-tensors' ``int-quantized`` format with dynamic int8 activations (W4A8,
W8A8): one signed code per int8 (``weight``), and each token's input rounded to an int8 grid of its own at run time.
It is the 4-bit scheme vLLM's CPU build runs on AVX2 (its ``Dynamic4bitLinearKernel``), where the AVX2 wheel lacks the
kernel for the weight-only format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsegen.quant.groups import GroupQuantizer, check_bits, check_groups, group_width

WORD = 32
KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes the CPU int4 kernel takes


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8 [rows, columns]`` codes -> ``int32 [rows, ceil(columns * bits / 32)]``, first code in the low bits."""
    per_word = WORD // bits
    rows, columns = codes.shape
    padded = F.pad(codes.to(torch.int64), (0, -columns % per_word)).view(rows, -1, per_word)
    shifts = torch.arange(0, WORD, bits, device=codes.device)
    words = (padded << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, as int32


def unpack(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """The inverse of ``pack``: ``uint8 [rows, columns]`` codes."""
    shifts = torch.arange(0, WORD, bits, device=packed.device)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    codes = (words.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return codes.flatten(1)[:, :columns].to(torch.uint8)


def _stamp(tensor: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's data is and how often it was written: a kernel's copy of it is rebuilt when either changes.
    (A tensor made under ``torch.inference_mode`` counts no writes.)"""
    return tensor.data_ptr(), 0 if tensor.is_inference() else tensor._version


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W = (codes - 2**(bits-1)) * scale`` per group of ``group_size`` input columns."""

    FORMAT = "pack-quantized"  # compressed-tensors' name for the layout
    CODES = "weight_packed"  # the buffer that holds the codes

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        check_bits(bits, group_size)
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        check_groups(in_features, group_size)
        self.group_size = group_width(group_size, in_features)
        self._register_codes(device)
        self.register_buffer("weight_scale", torch.ones(out_features, in_features // self.group_size,
                                                        dtype=torch.float16, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    def _register_codes(self, device: torch.device | str | None) -> None:
        words = -(-self.in_features * self.bits // WORD)
        self.register_buffer("weight_packed", torch.zeros(self.out_features, words, dtype=torch.int32, device=device))
        self.register_buffer("weight_shape", torch.tensor([self.out_features, self.in_features], device=device))

    def _store_codes(self, codes: torch.Tensor) -> None:
        self.weight_packed.copy_(pack(codes, self.bits))

    def codes(self) -> torch.Tensor:
        return unpack(self.weight_packed, self.bits, self.in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight: torch.Tensor, quantizer: GroupQuantizer) -> QuantLinear:
        """Store ``weight`` (already on ``quantizer``'s grids) in place of ``linear``."""
        module = cls(linear.in_features, linear.out_features, quantizer.bits, quantizer.width,
                     linear.bias is not None, linear.weight.dtype, linear.weight.device)
        module._store_codes(quantizer.codes(weight))
        module.weight_scale.copy_(quantizer.scales.half())
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.data)
        return module

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        scales = self.weight_scale.float().repeat_interleave(self.group_size, dim=1)
        return ((self.codes().float() - 2 ** (self.bits - 1)) * scales).to(dtype or self.weight_scale.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 4 and x.dtype == torch.bfloat16 and x.device.type == "cpu" and self.group_size in KERNEL_GROUPS:
            packed, scales_and_zeros = self._int4_kernel_weights()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), packed, self.group_size,
                                                             scales_and_zeros).view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def _int4_kernel_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes in the CPU int4 kernel's own layout, and its per-group ``(scale, offset)`` pairs (offset 0: the
        kernel computes ``(code - 8) * scale + offset``, our symmetric grid). Built on first use, and again if the
        stored weights change (loading a checkpoint into the module)."""
        def build() -> tuple[torch.Tensor, torch.Tensor]:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes().to(torch.int32), 2)
            scales = self.weight_scale.t().to(torch.bfloat16)
            return packed, torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()

        return self._kernel_copy(build, self.get_buffer(self.CODES), self.weight_scale)

    def _kernel_copy(self, build, *sources: torch.Tensor):
        """What ``build`` makes of ``sources`` for a kernel, kept until one of them is replaced or written."""
        key = tuple(part for source in sources for part in _stamp(source))
        if getattr(self, "_kernel_key", None) != key:
            self._kernel, self._kernel_key = build(), key
        return self._kernel

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


def token_codes(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s codes on a symmetric ``bits``-bit grid per token (last dimension) and their scales, as
    compressed-tensors' dynamic per-token activation scheme defines them: scale ``max|x| / ((2**bits - 1) / 2)``,
    codes clamped to the signed range."""
    top = 2 ** (bits - 1)
    scale = (x.float().abs().amax(-1, keepdim=True) / ((2**bits - 1) / 2)).clamp(min=torch.finfo(torch.float32).eps)
    return (x.float() / scale).round().clamp(-top, top - 1), scale


def quantize_per_token(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """``x`` rounded to its per-token grid (``token_codes``)."""
    codes, scale = token_codes(x, bits)
    return (codes * scale).to(x.dtype)


class DynamicInputQuantLinear(QuantLinear):
    """A ``QuantLinear`` stored as compressed-tensors' ``int-quantized`` format (``weight``: one signed code per int8)
    whose input is rounded to int8 per token before the product (W4A8 / W8A8, dynamic): the outputs an int8 x int4
    (or int8) kernel gives, up to its own rounding of the activations."""

    FORMAT = "int-quantized"
    CODES = "weight"

    def _register_codes(self, device: torch.device | str | None) -> None:
        self.register_buffer("weight", torch.zeros(self.out_features, self.in_features, dtype=torch.int8,
                                                   device=device))

    def _store_codes(self, codes: torch.Tensor) -> None:
        self.weight.copy_(codes.to(torch.int16) - 2 ** (self.bits - 1))

    def codes(self) -> torch.Tensor:
        return (self.weight.to(torch.int16) + 2 ** (self.bits - 1)).to(torch.uint8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 8 and self.group_size == self.in_features and x.device.type == "cpu":
            return self._int8_product(x)
        return super().forward(quantize_per_token(x))

    def _int8_product(self, x: torch.Tensor) -> torch.Tensor:
        """W8A8 with one scale per row as integers: int8 codes times int8 codes summed in int32
        (``torch._int_mm``), then both scales — what the dequantized product computes, without its float rounding, and
        without materializing the dequantized weights."""
        codes, scale = token_codes(x.reshape(-1, self.in_features))
        columns = self._kernel_copy(lambda: self.weight.t().contiguous(), self.weight)
        y = torch._int_mm(codes.to(torch.int8), columns).float() * scale * self.weight_scale.float().t()
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


LAYERS = {layer.FORMAT: layer for layer in (QuantLinear, DynamicInputQuantLinear)}
FORMATS = tuple(LAYERS)


def quant_linear_class(format: str) -> type[QuantLinear]:
    if format not in LAYERS:
        raise ValueError(f"unknown checkpoint format {format!r}; choose {' or '.join(FORMATS)}")
    return LAYERS[format]
