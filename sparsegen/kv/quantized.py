"""Low-bit storage for held keys and values (KIVI: Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache", 2024), in a form eviction can move token by token.

KIVI quantizes keys per channel (a few channels carry outliers, so a shared per-token range wastes the others'
levels) and values per token, and keeps the newest tokens in full precision. Its per-channel groups span many
tokens, which ties tokens together that eviction removes one at a time; here each key is divided by a per-channel
scale fixed at the row's first call (the outlier channels are a property of the layer, not of the token) and then
quantized per token, so every token's codes stand alone and move with it. On SmolLM2's keys this halves the error of
plain per-token quantization at 8, 4 and 2 bits (docs/kv.md, "Quantized KV"). Codes are asymmetric min-max integers,
packed into bytes; each token's scale and zero point are float16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (8, 4, 2)
TINY = 1e-6  # floor of a channel scale: a channel that was all zeros stays finite


@dataclass(frozen=True)
class KVQuantization:
    """``bits`` per key and value element; the ``residual`` newest tokens of each sequence are also kept in full
    precision and read from there (KIVI's residual)."""

    bits: int
    residual: int = 32

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"kv_bits must be one of {', '.join(map(str, BITS))}, got {self.bits}")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"the full-precision residual must be a number of tokens >= 0, got {self.residual}")

    def check(self, head_dim: int) -> None:
        if head_dim % (8 // self.bits):
            raise ValueError(f"{self.bits}-bit KV packs {8 // self.bits} values per byte; head_dim {head_dim} is not "
                             f"a multiple: choose --kv-bits 8")

    def token_bytes(self, head_dim: int) -> int:
        """Bytes of one token's key and value in one KV head: codes, and a float16 scale and zero point each."""
        return 2 * (head_dim * self.bits // 8 + 4)

    def row_bytes(self, kv_heads: int, head_dim: int, element_size: int) -> int:
        """Bytes one sequence holds per layer besides its tokens: fp32 channel scales and the residual ring."""
        ring = self.residual + 1 if self.residual else 0
        return kv_heads * head_dim * (4 + 2 * ring * element_size) + ring * 8

    def describe(self) -> dict:
        return {"kv_bits": self.bits, "kv_residual": self.residual}


def as_quantization(kv_bits: int | KVQuantization | None) -> KVQuantization | None:
    """``kv_bits`` as given to the cache and the entry points: a bit width (the default residual), a
    ``KVQuantization``, or None (no quantization)."""
    if kv_bits is None or isinstance(kv_bits, KVQuantization):
        return kv_bits
    return KVQuantization(kv_bits)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes ``[..., D]`` in ``[0, 2**bits)`` as bytes ``[..., D * bits / 8]`` (the first value lowest)."""
    per = 8 // bits
    if per == 1:
        return codes.to(torch.uint8)
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    return (codes.to(torch.uint8).unflatten(-1, (-1, per)) << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    return ((packed[..., None] >> shifts) & (2 ** bits - 1)).flatten(-2)


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (last dimension) asymmetric quantization: ``(packed codes, scale, zero)``, scale and zero float16
    ``[..., 1]``. ``dequantize`` returns ``x`` within half a step (``scale / 2``), plus float16's rounding of the
    zero point."""
    x = x.float()
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((high - low) / (2 ** bits - 1)).clamp(min=TINY).half()
    zero = low.half()
    codes = ((x - zero.float()) / scale.float()).round_().clamp_(0, 2 ** bits - 1)
    return pack(codes, bits), scale, zero


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values of ``quantize``'s output (written into ``out`` when given, of any floating dtype)."""
    # (out= has no gradient; dynamo does not take a strided out=, and inductor fuses the copy anyway)
    direct = out is not None and out.dtype == torch.float32 and not torch.is_grad_enabled() \
        and not torch.compiler.is_compiling()
    values = torch.addcmul(zero.float(), unpack(packed, bits).float(), scale.float(), out=out if direct else None)
    if out is not None and values is not out:
        out.copy_(values)
    return values if out is None else out
