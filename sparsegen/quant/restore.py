"""A loaded model re-stored in the fast kernels (``sparsegen.quant.fast``): which kernel each linear gets
(``--weights``, or a GGUF file's own types: ``gguf_plan``), the linears that read one input stacked into one call
(``SharedInput``), the embedding table in Q8_0 blocks, and the float weights' memory given back to the system.
"""

from __future__ import annotations

import torch
from torch import nn

from sparsegen.allocator import page_out, release_freed_memory
from sparsegen.quant.fast import (
    INT4_GROUP,
    BlockEmbedding,
    Int4Linear,
    Int8Linear,
    TiedHead,
    W4A8Linear,
    W5A8Linear,
    W8A8Linear,
    int4_grid,
    int4_pairs,
)

WEIGHTS = ("fp32", "int8", "int4", "w8a8", "w4a8", "w5a8", "gguf")
# ``gguf``: each linear at the bit width its GGUF file stores it with (a Q4_K_M file mixes Q4_K, Q5_0, Q6_K, Q8_0)
# in the integer kernels (w4a8, w5a8, w8a8) as llama.cpp computes
GGUF_INT4 = {"Q4_0", "Q4_1", "Q4_K"}  # as w4a8
GGUF_INT5 = {"Q5_0"}  # as w5a8 (its blocks come back exactly); every other type (Q5_K, Q6_K, Q8_0, ...) at 8 bits
GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}  # llama.cpp's names of a Llama/Gemma block's linears


def gguf_plan(path) -> dict[str, str]:
    """``module name -> kind`` for the linears of a GGUF file, by each tensor's stored type (full-precision tensors
    are left out: they stay as loaded): 4-bit types as ``w4a8``, Q5_0 as ``w5a8``, the others at 8 bits as ``w8a8``,
    llama.cpp's own arithmetic (its weights times 8-bit inputs in integer dot products); where FBGEMM is missing (not
    x86), PyTorch's weight-only ``int4`` and ``int8``. The LM head takes the output tensor's type, or the token
    embedding's when the two are tied. ``TABLE``, the token embedding, is there when the file stores it below 16 bits
    (as ``BlockEmbedding``, whatever its type: SmolLM2's and Gemma 3's are Q8_0, which it holds exactly)."""
    from sparsegen.models.gguf import tensor_types

    types = {name.removesuffix(".weight"): kind for name, kind in tensor_types(path).items()}
    plan = {TABLE: types.get(TABLE)}
    for name, kind in types.items():
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in GGUF_LINEARS:
            plan[f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}"] = kind
    plan["lm_head"] = types.get("output", types.get("token_embd"))
    integer = "fbgemm" in torch.backends.quantized.supported_engines
    four, eight = ("w4a8", "w8a8") if integer else ("int4", "int8")
    five = "w5a8" if integer else "int8"
    return {name: four if kind in GGUF_INT4 else five if kind in GGUF_INT5 else eight for name, kind in plan.items()
            if kind is not None and kind not in ("F32", "F16", "BF16")}


TABLE = "token_embd"  # a GGUF plan's key for the input embedding (llama.cpp's name)
INPUT_SHARERS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # a block's linears that read one input
_KERNELS = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear, "w4a8": W4A8Linear, "w5a8": W5A8Linear}
PACKED_LINEARS = tuple(_KERNELS.values())


def _input_sharers(kinds: dict[str, str]) -> list[list[str]]:
    """The groups of linears (full names) that read one input and are stored alike: each becomes one matmul."""
    groups = []
    for children in INPUT_SHARERS:
        parents = dict.fromkeys(name.rpartition(".")[0] for name in kinds if name.rpartition(".")[2] in children)
        for parent in parents:
            names = [f"{parent}.{child}" for child in children if f"{parent}.{child}" in kinds]
            for kind in dict.fromkeys(kinds[name] for name in names):
                alike = [name for name in names if kinds[name] == kind]
                if len(alike) > 1:
                    groups.append(alike)
    return groups


def _stacked(linears: list[nn.Linear]) -> nn.Linear:
    """One linear whose output rows are ``linears``' in order (each row is quantized on its own, so its codes are
    the ones it would get alone)."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=any(linear.bias is not None for linear in linears),
                        device="meta")  # (its weight and bias are set below: nothing to initialise)
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    if stacked.bias is not None:
        stacked.bias = nn.Parameter(torch.cat([torch.zeros(linear.out_features) if linear.bias is None else
                                               linear.bias.detach() for linear in linears]), requires_grad=False)
    return stacked


class SharedInput(nn.Module):
    """Linears that read the same input (a block's q/k/v, a gated MLP's gate and up) as one matmul, each still called
    where the model calls it (a ``Part``): a decode step's matmuls are small enough that a call costs as much as its
    bytes (SmolLM2 int4, one token: q, k and v take 59 µs in three calls, 30 µs in one). The first part called with
    an input computes every part's output; the others take theirs while that input is the one they are given, so a
    part called alone, or with another input, is still right."""

    class Part(nn.Module):
        def __init__(self, shared: SharedInput, index: int):
            super().__init__()
            object.__setattr__(self, "shared", shared)  # (registered once, on the block: not a child of each part)
            self.index = index
            self.in_features, self.out_features = shared.kernel.in_features, shared.widths[index]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.shared.part(x, self.index)

        def extra_repr(self) -> str:
            return f"out_features={self.out_features}: output {self.index} of one {type(self.shared.kernel).__name__}"

    def __init__(self, kernel: nn.Module, widths: list[int]):
        super().__init__()
        self.kernel, self.widths = kernel, widths
        self.pending: tuple[torch.Tensor, tuple[torch.Tensor, ...], int] | None = None  # (input, outputs, taken)

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        pending = self.pending  # (read once: a model called from two threads still gives each its own input's)
        if pending is None or pending[0] is not x:
            pending = (x, self.kernel(x).split(self.widths, -1), 0)
        source, outputs, taken = pending
        # (let go of the outputs once each part has its own: nothing is held between steps)
        self.pending = None if taken + 1 == len(self.widths) else (source, outputs, taken + 1)
        return outputs[index]


def quantize_weights(model: nn.Module, weights: str, plan: dict[str, str] | None = None) -> nn.Module:
    """Re-store ``model``'s decoder linears and LM head as ``weights`` (``fp32``: unchanged), and its embedding table
    in Q8_0 blocks (``BlockEmbedding``), in place; returns it. ``gguf`` takes ``plan`` (``gguf_plan`` of the model's
    file): each linear at its file's bit width, the table in blocks if the file stores it below 16 bits."""
    if weights not in WEIGHTS:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "gguf" and not plan:
        raise ValueError("--weights gguf needs a model loaded from a GGUF file (smollm2, gemma3-270m or a .gguf path)")
    if weights == "fp32":
        return model
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"--weights {weights} uses PyTorch's CPU kernels; on {device.type} run without it")
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and (".layers." in f".{name}" or name == "lm_head")]
    if plan is not None:
        targets = [(name, module) for name, module in targets if name in plan]
    linears = dict(targets)
    table = model.get_input_embeddings()
    table = table if (plan is None or TABLE in plan) and BlockEmbedding.fits(table) else None
    for weight in [module.weight for module in linears.values()] + ([table.weight] if table is not None else []):
        page_out(weight)  # (what loading left resident: each is read again only while it is packed)
    tied = table is not None and "lm_head" in linears and linears["lm_head"].weight is table.weight
    if table is not None:
        table = BlockEmbedding(table)
        model.set_input_embeddings(table)
    head = {"int4": "int8", "w4a8": "w8a8", "w5a8": "w8a8"}  # (the LM head stays at 8 bits, as a Q4 GGUF keeps it
    # (SmolLM2's: Q8_0): 4 bits there cost 6% perplexity on SmolLM2, while its Q4_1 decoder linears come back to their
    # own grid (+0.1%))
    kinds = {name: plan[name] if plan is not None else head.get(weights, weights) if name == "lm_head" else weights
             for name in linears}
    for names in _input_sharers(kinds):
        parent, _, _ = names[0].rpartition(".")
        children = [name.rpartition(".")[2] for name in names]
        shared = SharedInput(_KERNELS[kinds[names[0]]](_stacked([linears[name] for name in names])),
                             [linears[name].out_features for name in names])
        owner = model.get_submodule(parent)
        owner.add_module("_".join(["fused", *children]), shared)
        for index, child in enumerate(children):
            setattr(owner, child, SharedInput.Part(shared, index))
        for name in names:
            page_out(linears.pop(name).weight)
    if tied and weights == "gguf" and kinds["lm_head"] == "w8a8":  # (llama.cpp's head: the table's Q8_0 blocks)
        model.lm_head = TiedHead(table)
        linears.pop("lm_head")
    for name, module in linears.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, _KERNELS[kinds[name]](module))
        page_out(module.weight)  # (read from the mapped checkpoint to pack: its pages need not stay)
    if not targets:
        raise ValueError(f"{type(model).__name__} has no decoder linears to quantize")
    _own_memory(model)
    release_freed_memory()
    model.config.sparsegen_weights = weights
    return model


def _own_memory(model: nn.Module) -> None:
    """Copy what is left at full precision (embeddings, norms) out of the checkpoint file the model was memory-mapped
    from: one tensor viewing the file keeps the whole mapping, and the pages packing read, resident (SmolLM2 int4:
    1,006 MiB resident with the mapping, 601 MiB without, measured)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (*PACKED_LINEARS, BlockEmbedding, TiedHead)):
                continue  # (built in memory)
            for registry in (module._parameters, module._buffers):
                for tensor in registry.values():
                    if tensor is not None:
                        tensor.data = tensor.data.clone()


def dequantized(linear: nn.Linear, weights: str) -> torch.Tensor:
    """The weight ``weights`` stores for ``linear``, in fp32: what the kernels multiply by (the tests' reference)."""
    if weights in ("int8", "w8a8", "w4a8", "w5a8"):
        return _KERNELS[weights](linear).dequantized()
    codes, scale, low = int4_grid(linear.weight, INT4_GROUP)
    pairs = int4_pairs(scale, low).float()  # as the kernel holds them
    grouped = codes.float().view(*scale.shape, -1) - 8
    return (grouped * pairs[..., :1] + pairs[..., 1:]).view_as(linear.weight)
