"""Low-bit weights for speed: a loaded model's linears re-stored in the layouts of PyTorch's CPU weight-only kernels.

Decode at batch 1 reads every weight once per token, so its time is the weights' bytes over memory bandwidth: an
fp32 SmolLM2 reads 538 MB a token, its 4-bit GGUF 97 MB. ``quantize_weights(model, "int8")`` (in
``sparsegen.quant.restore``, which re-stores a model in these kernels) stores each decoder
linear and the LM head as int8 codes with one scale per output channel (``aten._weight_int8pack_mm``: a quarter of
the fp32 bytes); ``"int4"`` as 4-bit codes with a scale per group of 32 inputs (``aten._weight_int4pack_mm_for_cpu``,
the kernel torchao's int4 path calls: an eighth), asymmetric with a minimum per group as llama.cpp's Q4_1, the LM
head at 8 bits as Q4 GGUF files keep it. Both kernels take bfloat16 activations: each linear casts its
input to bfloat16 and its output back, so the rest of the model (attention, norms, the KV cache) keeps its dtype.
Round-to-nearest. The embedding table, of which a step reads one row, is stored in llama.cpp's Q8_0 blocks for its
memory (``BlockEmbedding``; exact for a Q8_0 GGUF's table); an LM head tied to it multiplies by those blocks
(``TiedHead``) under ``gguf``, so the table is held once, as llama.cpp holds it. Linears that read one input
and are stored alike (a block's q/k/v, a gated MLP's gate and up) are stacked into one kernel call
(``SharedInput``): at one token a call costs about as much as its bytes.

``"w8a8"`` multiplies int8 weights by inputs quantized to 7 bits a token, turned by a Hadamard rotation (FBGEMM's
integer kernels: faster on a CPU without native bfloat16, at about 1% perplexity; ``W8A8Linear``). ``"w4a8"``
multiplies llama.cpp's Q4_1 blocks by inputs quantized to 8 bits a block of 32, with integer dot products
(sparsegen's own kernel, ``W4A8Linear``), the LM head at w8a8; ``"w5a8"`` the same with llama.cpp's Q5_0 blocks
(``W5A8Linear``: 6 bits a weight read, where a Q4_K_M GGUF keeps most of Gemma 3's linears).

This is a runtime choice (``--weights``), not a checkpoint: ``sparsegen quantize`` writes GPTQ checkpoints.
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref

import torch
from torch import nn

from sparsegen import native
from sparsegen.allocator import page_out

INT4_GROUP = 32  # inputs per int4 scale: llama.cpp's Q4 block size
FEW_ROWS = 16  # up to a batch of decode steps: W8A8Linear turns their inputs by a sum, not a matmul
ROTATION_BLOCK = 64  # inputs a w8a8 linear turns together (W8A8Linear): SmolLM2's and Gemma 3's widths divide by it
ROWS_AT_ONCE = 4096  # rows quantized together: a large table's fp32 temporaries stay small (Gemma 3's LM head: 262,144)


def _row_chunks(weight: torch.Tensor):
    """``weight``'s rows in fp32, ``ROWS_AT_ONCE`` at a time, each chunk's pages released once it is quantized
    (``page_out``): quantizing a table whole made fp32 copies of it and kept its pages resident (Gemma 3's tied LM
    head: 671 MB each), which set the load's peak memory."""
    for start in range(0, weight.shape[0], ROWS_AT_ONCE):
        rows = weight[start:start + ROWS_AT_ONCE].detach()
        yield rows.float()
        page_out(rows)


class Int8Linear(nn.Module):
    """``y = x (codes * scale)^T + b``: int8 codes ``[out, in]``, one bfloat16 scale per output channel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        codes, scales = [], []
        for rows in _row_chunks(linear.weight):
            scale = (rows.abs().amax(1) / 127).clamp(min=1e-8).to(torch.bfloat16).float()  # as the kernel holds it
            codes.append((rows / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
            scales.append(scale.to(torch.bfloat16))
        self.register_buffer("codes", torch.cat(codes))
        self.register_buffer("scale", torch.cat(scales))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def dequantized(self) -> torch.Tensor:
        return self.codes.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scale).to(x.dtype)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


_PACKED: dict[int, torch.ScriptObject] = {}  # W8A8Linear's packed weights, by handle (see _w8a8_linear)
_HANDLES = itertools.count()  # (never reused, as an object's id can be once it is freed)
_LINEAR_DYNAMIC = torch.ops.quantized.linear_dynamic.default  # (the overload resolved once: a call costs less)
_LIBRARY = native.LIBRARY
_LIBRARY.define("w8a8_linear(Tensor x, int handle, int out_features) -> Tensor")
_LIBRARY.define("w4a8_linear(Tensor x, Tensor blocks, int out_features) -> Tensor")
_LIBRARY.define("w5a8_linear(Tensor x, Tensor blocks, int out_features) -> Tensor")
_LIBRARY.define("q8_0_linear(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor")
# a block of 32 weights: an fp16 scale, an fp16 minimum, 16 bytes of 4-bit codes (w5a8: and 4 of fifth bits, in
# planes of 32 bytes for 8 blocks, the last one whole)
FIFTH_PLANE, BLOCKS_A_PLANE = 32, 8


def row_bytes(groups: int, bits: int) -> int:
    """The bytes of a W4A8Linear (``bits=5``: W5A8Linear) row of ``groups`` blocks of 32 weights."""
    return 20 * groups + (-(-groups // BLOCKS_A_PLANE) * FIFTH_PLANE if bits == 5 else 0)


def _w8a8_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """``quantized::linear_dynamic`` over the packed weights ``handle`` names, as an op ``torch.compile`` keeps whole
    (dynamo cannot trace a call that takes the packed weights' ``ScriptObject``; an int it can). The op's C++ kernel
    (``w8a8_linear.cpp``) does this; this is the Python one, where that cannot be built, and the tests' reference."""
    return _LINEAR_DYNAMIC(x, _PACKED[handle], True)


@torch.library.register_fake("sparsegen::w8a8_linear", lib=_LIBRARY)
def _(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def _blocks_linear_shape(x: torch.Tensor, blocks: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


for _op in ("w4a8_linear", "w5a8_linear"):
    torch.library.register_fake(f"sparsegen::{_op}", _blocks_linear_shape, lib=_LIBRARY)


@torch.library.register_fake("sparsegen::q8_0_linear", lib=_LIBRARY)
def _(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def _input_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s rows as the kernels quantize them: ``(q, dx)``, codes ``[rows, groups, 32]`` (integers in fp32) and a
    scale a block of 32, ``x ~ dx * q``."""
    rows = x.reshape(-1, x.shape[-1]).float().view(-1, x.shape[-1] // INT4_GROUP, INT4_GROUP)
    scale = rows.abs().amax(-1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return torch.round(rows * inverse[..., None]), scale


def q8_0_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """``sparsegen::q8_0_linear`` in PyTorch ops, as ``w4a8_linear.cpp`` computes it (the integer sums exact, the
    float terms summed in another order): Q8_0 weights (int8 ``codes``, an fp16 scale a block of 32) times 8-bit
    inputs a block. The Python kernel where the C++ one cannot be built, and the tests' reference."""
    q, scale = _input_blocks(x)
    blocks = codes.view(out_features, -1, INT4_GROUP)
    y = torch.zeros(q.shape[0], out_features, dtype=torch.float64)
    for group in range(q.shape[1]):  # (a group at a time, as blocks_reference)
        sums = q[:, group].double() @ blocks[:, group].double().T
        y += sums * (scale[:, group, None] * scales[None, :, group].float()).double()
    return y.float().view(*x.shape[:-1], out_features)


def blocks_reference(x: torch.Tensor, blocks: torch.Tensor, out_features: int, bits: int = 4) -> torch.Tensor:
    """``sparsegen::w4a8_linear`` (``bits=5``: ``w5a8_linear``) in PyTorch ops, step for step as ``w4a8_linear.cpp``
    computes it (the integer sums exact, the float terms summed in another order): the Python kernel where the C++
    one cannot be built, and the tests' reference."""
    q, scale = _input_blocks(x)  # [rows, groups, 32], [rows, groups]
    d, low, codes = blocks_unpacked(blocks, bits)  # [out, groups], [out, groups], [out, groups, 32]
    y = (scale * q.sum(-1)).double() @ low.double().T
    for group in range(q.shape[1]):  # (a group at a time: a prefill chunk's [rows, out, groups] would not fit)
        sums = q[:, group].double() @ codes[:, group].double().T  # (exact: integers below 2^53)
        y += sums * (scale[:, group, None] * d[None, :, group]).double()
    return y.float().view(*x.shape[:-1], out_features)


def blocks_unpacked(blocks: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale, minimum, codes)`` of W4A8Linear's (``bits=5``: W5A8Linear's) packed rows ``[out, row_bytes]``
    (each: its groups' fp16 scales, their fp16 minimums, 16 bytes of codes a group, then the fifth bits' planes):
    fp32 ``[out, groups]`` twice and ``[out, groups, 32]`` codes in [0, 2^bits) (int64)."""
    out, width = blocks.shape
    groups = next(g for g in range(width // 20, 0, -1) if row_bytes(g, bits) == width)  # (row_bytes only grows)
    scales = blocks[:, :4 * groups].contiguous().view(torch.float16).float()  # [out, 2 * groups]
    nibbles = blocks[:, 4 * groups:20 * groups].reshape(out, groups, 16).long()
    codes = torch.cat([nibbles & 0xF, nibbles >> 4], -1)
    if bits == 5:
        planes = blocks[:, 20 * groups:].reshape(out, -1, 1, 1, FIFTH_PLANE).long()
        fifths = (planes >> _PLANE_BITS) & 1  # [out, planes, 4 pairs, low/high, 32 lanes]: slots in code_slot's order
        codes |= fifths.reshape(out, -1)[:, _code_slots(groups)] << 4
    return scales[:, :groups], scales[:, groups:], codes


_PLANE_BITS = (torch.arange(4)[:, None] + 4 * torch.arange(2))[..., None]  # pair p's low bits at bit p, high at p + 4


def _fifth_planes(fifths: torch.Tensor, groups: int) -> torch.Tensor:
    """Fifth bits ``[out, groups, 32]`` (0 or 1) as W5A8Linear's planes ``[out, planes * 32]`` (uint8): each plane's
    byte k holds lane k of four pairs' low-nibble vectors (bits 0-3) and high-nibble ones (bits 4-7), so that the
    kernel moves a pair's bits into its codes with one shift and one mask (``w4a8_linear.cpp``)."""
    out = fifths.shape[0]
    slots = torch.zeros(out, -(-groups // BLOCKS_A_PLANE) * BLOCKS_A_PLANE * 32, dtype=torch.long)
    slots[:, _code_slots(groups).flatten()] = fifths.reshape(out, -1).long()
    planes = (slots.view(out, -1, 4, 2, FIFTH_PLANE) << _PLANE_BITS).sum((2, 3))
    return planes.to(torch.uint8).view(out, -1)


def _code_slots(groups: int) -> torch.Tensor:
    """``[groups, 32]``: where the kernel keeps input ``i`` of each group among a row's codes (``code_slot`` in
    ``w4a8_linear.cpp``): per pair of groups, the first's 16 low codes, the second's, then their 16 high codes; an
    odd last group in its own order. A row's fifth bits take this order, 64 slots a pair (the odd group's 32 as a
    pair's low half)."""
    block, i = torch.arange(groups)[:, None], torch.arange(32)
    paired = block // 2 * 64 + (i >= 16) * 32 + block % 2 * 16 + i % 16
    return torch.where(block < groups // 2 * 2, paired, block * 32 + i)


def kernel_path() -> str:
    """Which dot products the w4a8, w5a8 and Q8_0 kernels take here: ``avx512-vnni``, ``avx2``, ``scalar`` (the C++
    kernels' paths, by the CPU and ``SPARSEGEN_KERNELS``), or ``python`` (they could not be built)."""
    return torch.ops.sparsegen_cpu.simd() if _native_kernels() == "c++" else "python"


@functools.cache
def _native_kernels() -> str:
    """Give ``sparsegen::w8a8_linear``, ``w4a8_linear``, ``w5a8_linear`` and ``q8_0_linear`` their CPU kernels, once:
    ``"c++"`` when sparsegen's kernels build (``native.build``), else ``"python"`` with a warning. Each call of a
    Python kernel goes through the interpreter, ~20-35 us on a 2-core AMD EPYC where FBGEMM's own call takes ~30 us at
    one token (121 calls a SmolLM2 token; a ``torch.library.custom_op`` wrapper cost ~20 us more still); the Python
    w4a8, w5a8 and q8_0 kernels are slower still."""
    failure = native.build()
    if failure is None:
        return "c++"
    warnings.warn(f"--weights w8a8|w4a8|w5a8: sparsegen's C++ kernels could not be built ({failure}); each linear "
                  "runs a Python kernel instead, ~20 us more a call (w4a8, w5a8: far slower). Install a C++ compiler "
                  "(g++) and ninja to build them.", stacklevel=3)
    _LIBRARY.impl("w8a8_linear", _w8a8_linear, "CPU")
    _LIBRARY.impl("w4a8_linear", blocks_reference, "CPU")
    _LIBRARY.impl("w5a8_linear", functools.partial(blocks_reference, bits=5), "CPU")
    _LIBRARY.impl("q8_0_linear", q8_0_reference, "CPU")
    return "python"


class W8A8Linear(nn.Module):
    """``y = q(x R) (codes * scale)^T + b``: int8 codes ``[out, in]`` of the weights turned by ``R`` with one fp32 scale
    per output channel, times the input quantized on the fly to 7-bit codes (FBGEMM's dynamic linear,
    ``quantized::linear_dynamic``): integer dot products, as llama.cpp's AVX2 kernels multiply its 4-bit weights by
    8-bit activations. On a CPU with AVX2 and no native bfloat16 the weight-only kernels (``int8``, ``int4``) take
    bfloat16 activations, which such a CPU emulates, so they gain little over fp32 matmuls; integer products do not
    depend on bfloat16 (docs/benchmarks-log.md compares them).

    FBGEMM takes one 7-bit scale a call (``reduce_range``: AVX2's 16-bit pair sums cannot hold 8-bit products). Two
    changes make that scale fit every value it codes:
    - each row (token) is divided by its own largest magnitude before the call and its output multiplied back (the
      product is linear in the input): one scale a call is then one scale a token, also over a prefill's chunk;
    - ``R`` is a Hadamard rotation of each block of ``ROTATION_BLOCK`` inputs (QuaRot's idea, applied to input and
      weights alike, so ``x R (W R)^T = x W^T``): a few outlier channels, which set a token's scale, are spread over
      their block, and the other values keep more of the 7 bits.
    Measured on SmolLM2 in ``docs/benchmarks-log.md``."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ValueError("--weights w8a8 needs PyTorch's FBGEMM kernels (x86 CPUs); use --weights int8")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.blocks = self.in_features // ROTATION_BLOCK if self.in_features % ROTATION_BLOCK == 0 else 0
        self.register_buffer("rotation", _hadamard(ROTATION_BLOCK) if self.blocks else None, persistent=False)
        codes = torch.empty(self.out_features, self.in_features, dtype=torch.int8)  # (filled a chunk at a time)
        scale = torch.empty(self.out_features, dtype=torch.double)
        zeros = torch.zeros_like(scale, dtype=torch.long)
        with warnings.catch_warnings():  # (PyTorch 2.13 marks quantized tensors deprecated: docs/benchmarks-log.md)
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            for start, rows in zip(itertools.count(0, ROWS_AT_ONCE), _row_chunks(linear.weight)):
                turned = self._rotated(rows, few_rows=0)  # (each row has its own scale: a chunk's codes are its own)
                chunk = slice(start, start + rows.shape[0])
                scale[chunk] = (turned.abs().amax(1) / 127).clamp(min=1e-8)
                codes[chunk] = torch.quantize_per_channel(turned, scale[chunk], zeros[chunk], 0, torch.qint8).int_repr()
            codes = torch._make_per_channel_quantized_tensor(codes, scale, zeros, 0)
        self.packed = torch.ops.quantized.linear_prepack(codes, None)  # (the bias is added after the rescale)
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = self.packed
        weakref.finalize(self, _PACKED.pop, self.handle, None)
        if _native_kernels() == "c++":
            torch.ops.sparsegen_fbgemm.hold(self.handle, self.packed)
            weakref.finalize(self, torch.ops.sparsegen_fbgemm.release, self.handle)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(),
                                                                  requires_grad=False)

    def _rotated(self, x: torch.Tensor, few_rows: int = FEW_ROWS) -> torch.Tensor:
        """``x`` ``[..., in]`` with each block of ``ROTATION_BLOCK`` inputs turned by the Hadamard rotation: up to
        ``few_rows`` rows (a decode step's) by a broadcast sum, which inductor fuses with the norm before it, more by a
        matmul (weights: always, whatever rows a chunk has)."""
        if not self.blocks:
            return x
        blocks = x.reshape(-1, self.blocks, ROTATION_BLOCK)
        if blocks.shape[0] <= few_rows:
            return (blocks[..., None] * self.rotation).sum(2).view(x.shape)
        return (blocks @ self.rotation).view(x.shape)

    def stored_tensors(self) -> list[torch.Tensor]:
        """The codes and scales the packed weights hold (FBGEMM's packing is not a tensor): what a step reads besides
        the bias, which is a parameter."""
        codes, _ = torch.ops.quantized.linear_unpack(self.packed)
        return [codes.int_repr(), codes.q_per_channel_scales().float()]

    def dequantized(self) -> torch.Tensor:
        """The weights in the input's own frame (the rotation undone: a Hadamard rotation is its own inverse)."""
        return self._rotated(torch.ops.quantized.linear_unpack(self.packed)[0].dequantize())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self._rotated(x.reshape(-1, self.in_features).float())
        peak = flat.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        y = torch.ops.sparsegen.w8a8_linear(flat / peak, self.handle, self.out_features) * peak
        y = y if self.bias is None else y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        turned = f", inputs turned in blocks of {ROTATION_BLOCK}" if self.blocks else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, "
                f"7-bit inputs scaled per token{turned}")


class W4A8Linear(nn.Module):
    """``y = x W^T + b`` with ``W = d * code + m`` in blocks of 32 inputs (4-bit codes, fp16 ``d`` and ``m``:
    llama.cpp's Q4_1 blocks, so a Q4_1 GGUF's weights land back on their own grid), times the input quantized to 8
    bits a block of 32 (llama.cpp's Q8_1), in integer dot products (``w4a8_linear.cpp``): 5 bits a weight read,
    against w8a8's 8, and no bfloat16 conversion, which PyTorch's int4 kernel pays on a CPU without native bfloat16."""

    BITS, GRID = 4, "Q4_1"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        out_features, in_features = linear.weight.shape
        kind = f"w{self.BITS}a8"
        if in_features % INT4_GROUP:
            raise ValueError(f"--weights {kind} needs input widths divisible by {INT4_GROUP}; a linear is "
                             f"{in_features} -> {out_features}: use --weights w8a8")
        self.register_buffer("blocks", torch.cat([self._packed(rows, kind) for rows in _row_chunks(linear.weight)]))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(),
                                                                  requires_grad=False)
        self.in_features, self.out_features = in_features, out_features
        _native_kernels()

    def _packed(self, rows: torch.Tensor, kind: str) -> torch.Tensor:
        """The kernel's rows for fp32 weight rows: per row its scales, its minimums, its codes (the kernel loads two
        groups' codes and eight scales at once), and for 5 bits the fifth bits, in the planes the kernel reads."""
        grouped = rows.view(rows.shape[0], -1, INT4_GROUP)
        scale, low, codes = self._grid(grouped)
        if not (scale.isfinite().all() and low.isfinite().all()):
            raise ValueError(f"--weights {kind} stores each group's scale and minimum in fp16, and a linear's weights "
                             "reach beyond its range (65504): use --weights w8a8")
        nibbles = ((codes[..., :16] & 0xF) | ((codes[..., 16:] & 0xF) << 4)).view(rows.shape[0], -1)
        parts = [scale.view(torch.uint8), low.view(torch.uint8), nibbles]
        if self.BITS == 5:
            parts.append(_fifth_planes(codes >> 4, codes.shape[1]))
        return torch.cat(parts, -1)

    @staticmethod
    def _grid(grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each group's fp16 scale and minimum, and its codes (uint8): round to nearest on Q4_1's grid, from the
        group's minimum to its maximum in 15 steps (a constant group's scale is fp16's smallest, not 0)."""
        _, scale, low = int4_grid(grouped.flatten(1), INT4_GROUP)
        # (stored at 16 bits, the codes rounded on that grid)
        scale, low = scale.clamp(min=torch.finfo(torch.float16).tiny).half(), low.half()
        codes = ((grouped - low.float()[..., None]) / scale.float()[..., None]).round().clamp(0, 15)
        return scale, low, codes.to(torch.uint8)

    def dequantized(self) -> torch.Tensor:
        d, low, codes = blocks_unpacked(self.blocks, self.BITS)
        return (codes.float() * d[..., None] + low[..., None]).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = torch.ops.sparsegen.w5a8_linear if self.BITS == 5 else torch.ops.sparsegen.w4a8_linear
        y = op(x.float(), self.blocks, self.out_features)
        y = y if self.bias is None else y + self.bias
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.BITS}-bit blocks of "
                f"{INT4_GROUP} ({self.GRID}), 8-bit inputs a block")


class W5A8Linear(W4A8Linear):
    """W4A8Linear with llama.cpp's Q5_0 blocks: ``W = d * (code - 16)``, 5-bit codes, one fp16 ``d`` a block of 32
    (stored as ``d * code + m`` with ``m = -16 d``, exact in fp16, so one kernel computes both): 6 bits a weight read.
    ``d`` is the block's largest magnitude (with its sign) over -16, as llama.cpp's quantizer takes it, so a Q5_0
    GGUF's weights, whose largest is always code 0, come back exactly on their own grid."""

    BITS, GRID = 5, "Q5_0"

    @staticmethod
    def _grid(grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        peak = grouped.gather(-1, grouped.abs().argmax(-1, keepdim=True)).squeeze(-1)
        scale = (peak / -16).half()
        tiny = torch.finfo(torch.float16).tiny  # (an all-zero group: codes 16, no 0 to divide by)
        scale = torch.where(scale == 0, torch.full_like(scale, tiny), scale)
        codes = (grouped / scale.float()[..., None]).round().add(16).clamp(0, 31)
        return scale, -16 * scale, codes.to(torch.uint8)


class BlockEmbedding(nn.Module):
    """An embedding table in llama.cpp's Q8_0 blocks: int8 codes with one fp16 scale a block of 32 values (8.5 bits a
    value, against fp32's 32). A step reads one row of the table, so this saves memory, not time: SmolLM2's table is
    113 MB in fp32, Gemma 3's 671 MB. A lookup gathers its rows' codes and scales and multiplies them (then by the
    table's ``embed_scale``, as Gemma's scaled embeddings do). A Q8_0 GGUF's table (SmolLM2's and Gemma 3's) comes back
    exactly: each block's largest magnitude is its fp16 scale times 127, so the scale and codes are found again."""

    BLOCK = 32

    @classmethod
    def fits(cls, table: nn.Module) -> bool:
        """A plain embedding, or a scaled one (``ScaledWordEmbedding``: the lookup times ``embed_scale``), whose rows
        divide into blocks; any other kind keeps its own table and lookup."""
        scaled = type(table).__name__.endswith("ScaledWordEmbedding") and hasattr(table, "embed_scale")
        return (isinstance(table, nn.Embedding) and (type(table) is nn.Embedding or scaled) and table.max_norm is None
                and table.embedding_dim % cls.BLOCK == 0)

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.num_embeddings, table.embedding_dim
        self.dtype = table.weight.dtype
        codes, scales = [], []
        for rows in _row_chunks(table.weight):
            blocks = rows.view(rows.shape[0], -1, self.BLOCK)
            scale = (blocks.abs().amax(-1) / 127).half()
            if not scale.isfinite().all():
                raise ValueError("an embedding table reaches beyond fp16's range (65504), where its 8-bit blocks keep "
                                 "their scales: use --weights fp32")
            divisor = torch.where(scale == 0, 1, scale.float())[..., None]  # (an all-zero block: codes 0)
            codes.append((blocks / divisor).round().clamp(-127, 127).to(torch.int8).flatten(1))
            scales.append(scale)
        self.register_buffer("codes", torch.cat(codes))
        self.register_buffer("scales", torch.cat(scales))
        scaled = getattr(table, "embed_scale", None)
        self.register_buffer("embed_scale", None if scaled is None else torch.as_tensor(scaled, dtype=torch.float32),
                             persistent=False)

    def _values(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return (codes.float().unflatten(-1, (-1, self.BLOCK)) * scales.float()[..., None]).flatten(-2)

    def dequantized(self) -> torch.Tensor:
        """The table's values in fp32 (what ``weight`` held, without ``embed_scale``): the tests' reference."""
        return self._values(self.codes, self.scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._values(self.codes[ids], self.scales[ids]).to(self.dtype)
        return rows if self.embed_scale is None else rows * self.embed_scale.to(self.dtype)

    def extra_repr(self) -> str:
        scaled = ", times embed_scale" if self.embed_scale is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 blocks of {self.BLOCK} (Q8_0){scaled}"


class TiedHead(nn.Module):
    """An LM head tied to its input embedding, multiplying by the table's own Q8_0 blocks (``BlockEmbedding``) with
    inputs quantized to 8 bits a block of 32 (``sparsegen::q8_0_linear``: llama.cpp's Q8_0 x Q8_0 arithmetic): the
    table is held once, where a head of its own packed a second copy (Gemma 3: 168 MB), and a Q8_0 GGUF's head keeps
    its file's weights, not a re-quantization of them."""

    def __init__(self, table: BlockEmbedding):
        super().__init__()
        object.__setattr__(self, "table", table)  # (the embedding's, not a second child: stored once)
        self.in_features, self.out_features = table.embedding_dim, table.num_embeddings
        _native_kernels()

    def stored_tensors(self) -> list[torch.Tensor]:
        """What a step reads: the whole table (``bench.roofline``)."""
        return [self.table.codes, self.table.scales]

    def dequantized(self) -> torch.Tensor:
        return self.table.dequantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.sparsegen.q8_0_linear(x.float(), self.table.codes, self.table.scales, self.out_features)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}: the input embedding's Q8_0 "
                f"blocks, 8-bit inputs a block")


def _hadamard(size: int) -> torch.Tensor:
    """The orthonormal Hadamard matrix of a power-of-two ``size`` (Sylvester's construction; symmetric, so its own
    inverse): entries +-1/sqrt(size), exact in fp32 for these sizes."""
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return matrix / size ** 0.5


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with ``W = (codes - 8) * scale`` per group of ``INT4_GROUP`` inputs, in the CPU int4
    kernel's packed layout."""

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP):
        super().__init__()
        out_features, in_features = linear.weight.shape
        if in_features % group or out_features % 16:
            raise ValueError(f"the CPU int4 kernel needs input widths divisible by {group} and output widths by 16; a "
                             f"linear is {in_features} -> {out_features}: use --weights int8")
        codes, scale, low = int4_grid(linear.weight, group)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2))
        # the kernel's [groups, out]
        self.register_buffer("scales", int4_pairs(scale, low).transpose(0, 1).contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features, self.group = in_features, out_features, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales).to(x.dtype)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group}"


def int4_grid(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit codes in [0, 15] (int32 ``[out, in]``) with a scale and a minimum per group
    (fp32 ``[out, groups]``): ``w = code * scale + low``. Asymmetric, as llama.cpp's Q4_1 blocks of 32 are: a GGUF's
    4-bit weights land back on their own grid."""
    out_features = weight.shape[0]
    grouped = weight.detach().float().view(out_features, -1, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    codes = ((grouped - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return codes.view(out_features, -1), scale, low


def int4_pairs(scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The CPU int4 kernel's bfloat16 ``(scale, offset)`` per group, ``[out, groups, 2]``: it computes
    ``(code - 8) * scale + offset``, so ``offset = low + 8 * scale`` gives ``code * scale + low``."""
    return torch.stack([scale, low + 8 * scale], -1).to(torch.bfloat16)
