"""Low-bit storage for held keys and values (KIVI: Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache", 2024), in a form eviction can move token by token.

KIVI quantizes keys per channel (a few channels carry outliers, so a shared per-token range wastes the others'
levels) and values per token, and keeps the newest tokens in full precision. Its per-channel groups span many
tokens, which ties tokens together that eviction removes one at a time; here each key is divided by a per-channel
scale fixed at the row's first call (the outlier channels are a property of the layer, not of the token) and then
quantized per token, so every token's codes stand alone and move with it. On SmolLM2's keys this halves the error of
plain per-token quantization at 8, 4 and 2 bits (docs/kv.md, "Quantized KV"). Codes are asymmetric min-max integers,
packed into bytes; each token's scale and zero point are float16.

``kv_bits=16`` is not quantization: keys and values held as float16 numbers (llama.cpp's default cache type), half
an fp32 cache's bytes, read by CPU decode steps as they are (``sparsegen::decode_attention`` widens them as it loads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (16, 8, 4, 2)  # 16: float16 numbers, no codes (32, ``AS_COMPUTED``: as the model computes them)
TINY = 1e-6  # floor of a channel scale: a channel that was all zeros stays finite


@dataclass(frozen=True)
class KVQuantization:
    """``bits`` per key and value element; the ``residual`` newest tokens of each sequence are also kept in full
    precision and read from there (KIVI's residual). 16 bits: float16 numbers, no residual."""

    bits: int
    residual: int = 32

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"kv_bits must be one of {', '.join(map(str, BITS))}, got {self.bits}")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"the full-precision residual must be a number of tokens >= 0, got {self.residual}")
        if not self.codes:  # (every token is as precise as a residual would be)
            object.__setattr__(self, "residual", 0)

    @property
    def codes(self) -> bool:
        """Whether keys and values are held as codes with scales (8, 4, 2 bits), not as float16 numbers."""
        return self.bits < 16

    def check(self, head_dim: int) -> None:
        if self.codes and head_dim % (8 // self.bits):
            raise ValueError(f"{self.bits}-bit KV packs {8 // self.bits} values per byte; head_dim {head_dim} is not "
                             f"a multiple: choose --kv-bits 8")

    def token_bytes(self, head_dim: int) -> int:
        """Bytes of one token's key and value in one KV head: codes, and a float16 scale and zero point each."""
        return 2 * (head_dim * self.bits // 8 + (4 if self.codes else 0))

    def row_bytes(self, kv_heads: int, head_dim: int, element_size: int) -> int:
        """Bytes one sequence holds per layer besides its tokens: fp32 channel scales and the residual ring."""
        if not self.codes:
            return 0
        ring = self.residual + 1 if self.residual else 0
        return kv_heads * head_dim * (4 + 2 * ring * element_size) + ring * 8

    def describe(self) -> dict:
        return {"kv_bits": self.bits, "kv_residual": self.residual}


def policy_and_bits(name: str) -> tuple[str, int | None]:
    """A row named ``POLICY+kvBITS`` (``h2o+kv4``, ``full+kv16``: that policy with its cache in BITS bits), as
    ``compare`` and ``bench`` take it: the policy's name and the bits (None without the suffix)."""
    policy, suffix, bits = name.partition("+kv")
    if suffix and not bits.isdigit():
        raise ValueError(f"{name!r}: write a row holding K/V in BITS bits as POLICY+kvBITS, e.g. h2o+kv4 or h2o+kv16")
    return policy, int(bits) if bits else None


AS_COMPUTED = 32  # ``kv_bits`` for K/V held as the model computes them, whatever the model's default (``held_kv``)
INTEGER_WEIGHTS = ("w8a8", "w4a8", "w5a8", "gguf")  # the weights sparsegen's integer kernels run, as llama.cpp's do


def as_quantization(kv_bits: int | KVQuantization | None) -> KVQuantization | int | None:
    """``kv_bits`` as given to the cache and the entry points, checked: a bit width (the default residual), a
    ``KVQuantization``, ``AS_COMPUTED`` (kept as it is), or None (the model's default)."""
    if kv_bits is None or kv_bits == AS_COMPUTED or isinstance(kv_bits, KVQuantization):
        return kv_bits
    return KVQuantization(kv_bits)


def default_kv_bits(model: torch.nn.Module) -> int | None:
    """How a model's caches hold K/V unless told: float16 numbers where its linears run in sparsegen's integer
    kernels on a CPU (a GGUF model's default; llama.cpp's default cache type: half the bytes a decode step's
    attention reads, rounding each K/V to 11 significant bits), else as the model computes them."""
    from sparsegen.models.anatomy import weights_of

    on_cpu = next(model.parameters()).device.type == "cpu"
    return 16 if on_cpu and weights_of(model) in INTEGER_WEIGHTS else None


def held_kv(model: torch.nn.Module, kv_bits: int | KVQuantization | None) -> KVQuantization | None:
    """How a cache of ``model`` holds K/V for ``kv_bits``: None means the model's default (``default_kv_bits``),
    ``AS_COMPUTED`` as computed (the result None)."""
    kv_bits = as_quantization(default_kv_bits(model) if kv_bits is None else kv_bits)
    return None if kv_bits == AS_COMPUTED else kv_bits


def held_kv_description(model: torch.nn.Module, kv_bits: int | KVQuantization | None) -> dict:
    """``held_kv``'s answer as a result records it (``kv_bits``, ``kv_residual``; nothing where as computed)."""
    held = held_kv(model, kv_bits)
    return held.describe() if held is not None else {}


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


@dataclass
class HeldCodes:
    """A quantized layer's held keys or values as a decode step's attention reads them on a CPU: straight from the
    codes, never decoded into an fp32 copy of the cache. Dequantizing every held slot each step (unpack, scale,
    shift, channel scales, residual) took several passes over an fp32 cache and made 4-bit K/V slower than fp32.
    Here the scale, zero point and channel scales are moved out of the sums (``q . (c * (z + s * code)) = z *
    sum(q * c) + s * ((q * c) . code)``; ``sum_t p * (z + s * code) = sum_t p * z + (p * s) . code``), and each
    ``code`` is taken out of its byte inside the sum, so a compiled step reads each slot's bytes once (eager, where
    nothing fuses, the codes are unpacked into one float copy for a matmul). Slots whose token is in the
    full-precision residual (``fresh``) read its ring ``entry`` instead."""

    codes: torch.Tensor  # uint8 [B, H, T, D * bits / 8]
    scale: torch.Tensor  # float16 [B, H, T, 1]
    zero: torch.Tensor  # float16 [B, H, T, 1]
    bits: int
    channels: torch.Tensor | None  # keys: each channel's scale [B, H, 1, D]; values: None
    ring: torch.Tensor | None  # the residual's full-precision keys or values [B, H, R, D]; None without one
    fresh: torch.Tensor | None  # bool [B, H, T]: the slot's token is in the ring
    entry: torch.Tensor | None  # int64 [B, H, T]: its ring entry

    dtype = torch.float32

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:3], self.codes.shape[-1] * 8 // self.bits))

    def _code(self, part: int) -> torch.Tensor:
        """Each byte's ``part``-th value (the one at ``d = byte * per + part``), as floats ``[B, H, T, bytes]``."""
        if self.bits == 8:
            return self.codes.float()
        return ((self.codes >> (self.bits * part)) & (2 ** self.bits - 1)).float()

    def scores(self, queries: torch.Tensor) -> torch.Tensor:
        """``queries @ keys.T``: ``[B, H, M, D]`` queries against the held keys, ``[B, H, M, T]``."""
        scaled = queries * self.channels
        if torch.compiler.is_compiling():
            per = 8 // self.bits
            parts = scaled.unflatten(-1, (-1, per))  # [B, H, M, bytes, per]
            raw = sum((parts[:, :, :, None, :, s] * self._code(s)[:, :, None]).sum(-1) for s in range(per))
        else:  # eager: one unpacked copy and a matmul (broadcast products cost more than the copy)
            raw = scaled @ unpack(self.codes, self.bits).float().transpose(-1, -2)
        out = self.zero.float().transpose(-1, -2) * scaled.sum(-1, keepdim=True) \
            + self.scale.float().transpose(-1, -2) * raw
        if self.ring is None:
            return out
        ring = (queries @ self.ring.transpose(-1, -2)).gather(-1, self.entry[:, :, None].expand_as(out))
        return torch.where(self.fresh[:, :, None], ring, out)

    def weigh(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs @ values``: ``[B, H, M, T]`` weights over the held values, ``[B, H, M, D]``."""
        from_ring = None
        if self.ring is not None:
            fresh = self.fresh[:, :, None]
            from_ring = probs.new_zeros(*probs.shape[:3], self.ring.shape[2]).scatter_add(
                -1, self.entry[:, :, None].expand_as(probs), probs.masked_fill(~fresh, 0)) @ self.ring
            probs = probs.masked_fill(fresh, 0)
        weights = probs * self.scale.float().transpose(-1, -2)
        if torch.compiler.is_compiling():
            parts = [(weights[..., None] * self._code(s)[:, :, None]).sum(-2) for s in range(8 // self.bits)]
            out = torch.stack(parts, -1).flatten(-2)
        else:
            out = weights @ unpack(self.codes, self.bits).float()
        out = out + (probs * self.zero.float().transpose(-1, -2)).sum(-1, keepdim=True)
        return out if from_ring is None else out + from_ring
