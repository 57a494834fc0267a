"""Weight-only quantization (round-to-nearest or GPTQ, 4 or 8 bits, per-group scales) for compressed checkpoints."""

from sparsegen.quant.linear import QuantLinear
from sparsegen.quant.quantize import METHODS, QuantizeConfig, quantize_model

__all__ = ["METHODS", "QuantLinear", "QuantizeConfig", "quantize_model"]
