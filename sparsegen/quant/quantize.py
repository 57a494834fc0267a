"""Weight-only quantization of a causal LM's decoder linears: round-to-nearest, or GPTQ calibrated layer by layer.

Every ``nn.Linear`` inside a decoder layer becomes a ``QuantLinear`` (embeddings and the output layer stay in
float, as in GPTQ). GPTQ reuses SparseGPT's sweep with a quantizer and no pruning, feeding each layer the
outputs of the already-quantized layers before it. Zeros of a pruned checkpoint stay zero under both methods.
The checkpoint is in compressed-tensors' ``pack-quantized`` format (``config.quantization_config``), or with
``format="int-quantized"`` its W4A8/W8A8 scheme (inputs rounded to int8 per token at run time): vLLM serves it,
transformers loads it with the ``compressed-tensors`` package, and ``sparsegen.load`` rebuilds it without.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from torch import nn

from sparsegen.models.anatomy import decoder_layers, linears
from sparsegen.models.calibration import calibrated_layers
from sparsegen.pruning.sparsegpt import sparsegpt_prune
from sparsegen.quant.groups import GroupQuantizer, check_bits, check_groups, round_to_nearest
from sparsegen.quant.linear import FORMATS, QuantLinear, quant_linear_class

METHODS = ("rtn", "gptq")
CONFIG_KEY = "quantization_config"


@dataclass
class QuantizeConfig:
    bits: int = 4
    group_size: int | None = None  # input columns per scale; 0 = one per output row; None = the largest that fits
    method: str = "gptq"
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    batch_size: int = 8
    format: str = "pack-quantized"  # or "int-quantized": int8 activations per token (W4A8, W8A8)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}; choose rtn or gptq")
        check_bits(self.bits, self.group_size or 0)
        quant_linear_class(self.format)
        if self.per_row and self.group_size:
            raise ValueError("8-bit weights with int8 activations (W8A8) take one scale per row in vLLM's kernels; "
                             "use --group-size 0")

    @property
    def per_row(self) -> bool:
        """W8A8: one scale per row, its only layout (and so its default)."""
        return self.format == "int-quantized" and self.bits == 8


GROUP_SIZES = (128, 64, 32, 16)  # what kernels take; the largest that cuts every linear evenly is the default


def fitting_group_size(model: torch.nn.Module) -> int:
    """The largest of ``GROUP_SIZES`` that divides every decoder linear's inputs (SmolLM2's 576: 64), else 0 (one
    scale per output row)."""
    columns = {linear.in_features for layer in decoder_layers(model) for linear in linears(layer).values()}
    return next((size for size in GROUP_SIZES if all(c % size == 0 or c < size for c in columns)), 0)


def _quantize_linear(linear: nn.Linear, config: QuantizeConfig, hessian: torch.Tensor | None) -> QuantLinear:
    weight = linear.weight.data
    if hessian is None:
        quantizer = round_to_nearest(weight, config.bits, config.group_size)
        rounded = weight
    else:
        quantizer = GroupQuantizer(weight.shape[0], weight.shape[1], config.bits, config.group_size, weight.device)
        rounded, _ = sparsegpt_prune(weight, hessian, quantizer=quantizer, keep_zeros=True)
    return quant_linear_class(config.format).from_linear(linear, rounded, quantizer)


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
    if config.group_size is None:
        config = dataclasses.replace(config, group_size=0 if config.per_row else fitting_group_size(model))
    for layer in decoder_layers(model):  # refused before any layer changes
        for linear in linears(layer).values():
            check_groups(linear.in_features, config.group_size)
    t0 = time.perf_counter()
    layers = []
    statistic = "hessian" if config.method == "gptq" else None
    for index, layer, found, stats in calibrated_layers(model, ids, statistic, config.batch_size,
                                                          f"quantize ({config.method}, int{config.bits})", progress):
        for name, linear in found.items():
            quantized = _quantize_linear(linear, config, stats[name].hessian() if name in stats else None)
            layer.set_submodule(name, quantized)
            error = (quantized.dequantized(torch.float32) - linear.weight.float()).pow(2).mean().item()
            layers.append({"name": f"layers.{index}.{name}", "shape": list(linear.weight.shape),
                           "bytes_before": _bytes(linear), "bytes_after": _bytes(quantized), "mse": error})
    model.config.quantization_config = compressed_tensors_config(model, config.bits, config.group_size, config.format)
    return {
        "method": config.method, "bits": config.bits, "group_size": config.group_size, "format": config.format,
        "nsamples": config.nsamples if statistic else 0, "seqlen": config.seqlen if statistic else None,
        "seed": config.seed, "seconds": round(time.perf_counter() - t0, 2),
        "linear_bytes_before": sum(r["bytes_before"] for r in layers),
        "linear_bytes_after": sum(r["bytes_after"] for r in layers),
        "model_bytes": sum(t.nbytes for t in [*model.parameters(), *model.buffers()]),
        "layers": layers,
    }


DYNAMIC_INT8_INPUTS = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}


def compressed_tensors_config(model: torch.nn.Module, bits: int, group_size: int,
                              format: str = "pack-quantized") -> dict:
    """``quantization_config`` of a model whose decoder linears are ``QuantLinear``s: one symmetric int-weight scheme
    (W4A16 or W8A16; W4A8 or W8A8 in the ``int-quantized`` format) for every ``Linear``, and the ones left in float
    (the output layer) ignored."""
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False, "observer": "minmax",
               "strategy": "group" if group_size else "channel", "group_size": group_size or None}
    inputs = DYNAMIC_INT8_INPUTS if format == "int-quantized" else None
    ignore = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    return {"quant_method": "compressed-tensors", "format": format, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None}},
            "ignore": ignore}


def _scheme(recorded: dict) -> dict:
    """The weight scheme of a compressed-tensors config sparsegen can rebuild, or a clear error."""
    groups = list((recorded.get("config_groups") or {}).values())
    weights = groups[0].get("weights") or {} if len(groups) == 1 else {}
    inputs = (groups[0].get("input_activations") or {}) if len(groups) == 1 else {}
    inputs_read = (all(inputs.get(key) == value for key, value in DYNAMIC_INT8_INPUTS.items())
                   if recorded.get("format") == "int-quantized" else not inputs)
    if not (weights.get("type") == "int" and weights.get("symmetric") and weights.get("num_bits") in (4, 8)
            and weights.get("strategy") in ("group", "channel") and inputs_read):
        raise ValueError("sparsegen rebuilds compressed-tensors checkpoints with one symmetric 4- or 8-bit integer "
                         "weight scheme (W4A16, W8A16; W4A8, W8A8 with dynamic per-token int8 inputs in the "
                         "int-quantized format); load this one with transformers and the compressed-tensors package")
    return weights


def ours(recorded) -> bool:
    """Whether a ``quantization_config`` is one ``rebuild`` reads (compressed-tensors, pack- or int-quantized)."""
    return (isinstance(recorded, dict) and recorded.get("quant_method") == "compressed-tensors"
            and recorded.get("format") in FORMATS)


def rebuild(model: torch.nn.Module, recorded: dict) -> None:
    """Swap the linears a compressed-tensors config quantizes for empty ``QuantLinear``s, ready for the weights."""
    weights = _scheme(recorded)
    group_size = weights["group_size"] if weights["strategy"] == "group" else 0
    ignore = set(recorded.get("ignore") or ())
    if any(name.startswith("re:") for name in ignore):
        raise ValueError("sparsegen does not read regular-expression ignore lists; load this checkpoint with "
                         "transformers and the compressed-tensors package")
    layer_class = quant_linear_class(recorded["format"])
    for name, linear in list(model.named_modules()):
        if type(linear) is nn.Linear and name not in ignore:
            model.set_submodule(name, layer_class(linear.in_features, linear.out_features, weights["num_bits"],
                                                  group_size, linear.bias is not None, linear.weight.dtype,
                                                  linear.weight.device))

