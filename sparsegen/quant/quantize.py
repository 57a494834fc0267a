"""Weight-only quantization of a causal LM's decoder linears: round-to-nearest, or GPTQ calibrated layer by layer.

Every ``nn.Linear`` inside a decoder layer becomes a ``QuantLinear`` (embeddings and the output layer stay in
float, as in GPTQ). GPTQ reuses SparseGPT's sweep with a quantizer and no pruning, feeding each layer the
outputs of the already-quantized layers before it. Zeros of a pruned checkpoint stay zero under both methods.
The layout (bits, group size, which linears) is written to ``config.sparsegen_quantization`` so
``sparsegen.load`` rebuilds the model before reading its weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from sparsegen.models.anatomy import decoder_layers
from sparsegen.models.calibration import calibrated_layers
from sparsegen.models.rebuild import register_rebuilder
from sparsegen.pruning.sparsegpt import sparsegpt_prune
from sparsegen.quant.groups import check_bits, round_to_nearest, GroupQuantizer
from sparsegen.quant.linear import QuantLinear

METHODS = ("rtn", "gptq")
CONFIG_KEY = "sparsegen_quantization"


@dataclass
class QuantizeConfig:
    bits: int = 4
    group_size: int = 128  # input columns per scale; 0 = one scale per output row
    method: str = "gptq"
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    batch_size: int = 8

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}; choose rtn or gptq")
        check_bits(self.bits, self.group_size)


def _quantize_linear(linear: nn.Linear, config: QuantizeConfig, hessian: torch.Tensor | None) -> QuantLinear:
    weight = linear.weight.data
    if hessian is None:
        quantizer = round_to_nearest(weight, config.bits, config.group_size)
        rounded = weight
    else:
        quantizer = GroupQuantizer(weight.shape[0], weight.shape[1], config.bits, config.group_size, weight.device)
        rounded, _ = sparsegpt_prune(weight, hessian, quantizer=quantizer, keep_zeros=True)
    return QuantLinear.from_linear(linear, rounded, quantizer)


def _bytes(module: nn.Module) -> int:
    return sum(t.nbytes for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])


@torch.no_grad()
def quantize_model(model: torch.nn.Module, config: QuantizeConfig, ids: torch.Tensor | None = None,
                   progress: bool = True) -> dict:
    """Swap every decoder linear of ``model`` for a ``QuantLinear`` in place; ``ids`` are GPTQ's calibration tokens.

    Returns the report saved as ``quantization.json``: per linear its shape, bytes before and after, and the
    mean squared change of its weight.
    """
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError("this model is already quantized; quantize its float checkpoint instead")
    if config.method == "gptq" and ids is None:
        raise ValueError("gptq needs calibration data")
    t0 = time.perf_counter()
    layers = []
    statistic = "hessian" if config.method == "gptq" else None
    for index, layer, linears, stats in calibrated_layers(model, ids, statistic, config.batch_size,
                                                          f"quantize ({config.method}, int{config.bits})", progress):
        for name, linear in linears.items():
            quantized = _quantize_linear(linear, config, stats[name].hessian() if name in stats else None)
            layer.set_submodule(name, quantized)
            error = (quantized.dequantized(torch.float32) - linear.weight.float()).pow(2).mean().item()
            layers.append({"name": f"layers.{index}.{name}", "shape": list(linear.weight.shape),
                           "bytes_before": _bytes(linear), "bytes_after": _bytes(quantized), "mse": error})
    model.config.update({CONFIG_KEY: layout(model, config)})
    return {
        "method": config.method, "bits": config.bits, "group_size": config.group_size,
        "nsamples": config.nsamples if statistic else 0, "seqlen": config.seqlen if statistic else None,
        "seed": config.seed, "seconds": round(time.perf_counter() - t0, 2),
        "linear_bytes_before": sum(r["bytes_before"] for r in layers),
        "linear_bytes_after": sum(r["bytes_after"] for r in layers),
        "model_bytes": sum(t.nbytes for t in [*model.parameters(), *model.buffers()]),
        "layers": layers,
    }


def layout(model: torch.nn.Module, config: QuantizeConfig) -> dict:
    names = [f"{index}.{name}" for index, layer in enumerate(decoder_layers(model))
             for name, module in layer.named_modules() if isinstance(module, QuantLinear)]
    return {"method": config.method, "bits": config.bits, "group_size": config.group_size, "linears": names}


def rebuild(model: torch.nn.Module, recorded: dict) -> None:
    """Swap the recorded linears of a freshly built model for empty ``QuantLinear``s, ready for the saved weights."""
    layers = decoder_layers(model)
    for entry in recorded["linears"]:
        index, _, name = entry.partition(".")
        layer = layers[int(index)]
        linear = layer.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"config.json records {entry} as quantized, but the model has no linear layer there")
        layer.set_submodule(name, QuantLinear(linear.in_features, linear.out_features, recorded["bits"],
                                              recorded["group_size"], linear.bias is not None, linear.weight.dtype,
                                              linear.weight.device))


register_rebuilder(CONFIG_KEY, rebuild, order=1)  # after structured pruning has sized the linears
